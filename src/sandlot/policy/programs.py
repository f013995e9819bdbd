"""What the gate knows about particular programs: their flags, and which operands are paths.

A :class:`ProgramSpec` says, for one program, which short and long options exist and what
canonical name each has (``-r``, ``-R`` and ``--recursive`` of ``rm`` are all ``recursive``),
which options take an argument, which operands are paths, and which paths the program writes.
Only programs whose exact spelling matters to policy are listed; every other program gets its
flags reported as written.

This module is data plus one parser; it imports nothing from sandlot.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final, Literal

__all__ = ["PROGRAMS", "ProgramSpec", "spec_for"]

OperandKind = Literal["paths", "pathlike", "none"]
WriteKind = Literal["none", "operands", "last"]


@dataclass(frozen=True, slots=True)
class ProgramSpec:
    """How one program reads its command line."""

    short: Mapping[str, str] = field(default_factory=dict)
    """Short option letter -> canonical flag name."""
    long: Mapping[str, str] = field(default_factory=dict)
    """Long option name (without ``--``) -> canonical flag name."""
    short_args: frozenset[str] = frozenset()
    """Short letters whose option takes an argument (``-n 3`` or ``-n3``)."""
    short_optargs: frozenset[str] = frozenset()
    """Short letters with an optional argument, only ever attached (``sed -i.bak``)."""
    long_args: frozenset[str] = frozenset()
    """Long names that take an argument (``--output FILE`` or ``--output=FILE``)."""
    operands: OperandKind = "paths"
    """Which operands are paths: all, only those that look like paths, or none (URLs...)."""
    skip_first_unless: frozenset[str] | None = None
    """When set, the first operand is not a path (a mode, an owner, a sed script) unless one of
    these canonical flags supplied it instead (``chmod --reference``, ``sed -e``)."""
    writes: WriteKind = "none"
    """Which path operands the program writes (creates, modifies or removes)."""
    writes_if: frozenset[str] = frozenset()
    """Operands are written only when one of these flags is present (``sed -i``)."""
    writes_unless: frozenset[str] = frozenset()
    """Operands are not written when one of these flags is present (``fdisk -l``)."""
    write_flags: frozenset[str] = frozenset()
    """Canonical flags whose argument is a path the program writes (``curl -o FILE``)."""
    path_flags: frozenset[str] = frozenset()
    """Canonical flags whose argument is a path it reads (``chmod --reference=FILE``)."""
    mode_operands: bool = False
    """``chmod``: an argument such as ``-w`` or ``-rwx`` is a mode, not options."""


def _short(spec: str) -> dict[str, str]:
    """``"rR=recursive f=force"`` -> {"r": "recursive", "R": "recursive", "f": "force"}."""
    out: dict[str, str] = {}
    for item in spec.split():
        letters, _, name = item.partition("=")
        for ch in letters:
            out[ch] = name
    return out


def _long(spec: str) -> dict[str, str]:
    """``"recursive no-preserve-root quiet=silent"`` -> canonical names with ``_``."""
    out: dict[str, str] = {}
    for item in spec.split():
        name, _, canon = item.partition("=")
        out[name] = canon or name.replace("-", "_")
    return out


def _names(spec: str) -> frozenset[str]:
    return frozenset(spec.split())


_RM = ProgramSpec(
    short=_short("rR=recursive f=force i=interactive I=interactive_once d=dir v=verbose"),
    long=_long(
        "recursive force interactive dir verbose one-file-system no-preserve-root preserve-root"
    ),
    writes="operands",
)
_CHMOD = ProgramSpec(
    short=_short("R=recursive c=changes f=silent v=verbose"),
    long=_long(
        "recursive changes silent quiet=silent verbose reference no-preserve-root preserve-root"
    ),
    long_args=_names("reference"),
    skip_first_unless=_names("reference"),
    path_flags=_names("reference"),
    writes="operands",
    mode_operands=True,
)
_CHOWN = ProgramSpec(
    short=_short(
        "R=recursive h=no_dereference H=traverse_args L=traverse_all P=no_traverse c=changes f=silent v=verbose"
    ),
    long=_long(
        "recursive no-dereference dereference from reference changes silent quiet=silent verbose "
        "no-preserve-root preserve-root"
    ),
    long_args=_names("reference from"),
    skip_first_unless=_names("reference"),
    path_flags=_names("reference"),
    writes="operands",
)
_MKFS = ProgramSpec(
    short=_short(
        "b=block_size C=cluster_size d=root_dir E=extended F=fat_size G=flex_group g=group_blocks "
        "I=inode_size i=inode_ratio J=journal L=label l=bad_blocks_file M=last_mounted m=reserved "
        "N=inodes n=volume_name O=features o=creator_os r=revision S=sector_size s=sectors "
        "T=usage t=type U=uuid c=check f=force q=quiet v=verbose"
    ),
    short_args=frozenset("bCdEFGgIiJLlMmNnOorSsTtU"),
    operands="pathlike",
    writes="operands",
)
_SHRED = ProgramSpec(
    short=_short("u=remove z=zero f=force v=verbose x=exact n=iterations s=size"),
    long=_long("remove zero force verbose exact iterations size random-source"),
    short_args=frozenset("ns"),
    long_args=_names("iterations size random-source"),
    path_flags=_names("random_source"),
    writes="operands",
)
_WIPEFS = ProgramSpec(
    short=_short(
        "a=all f=force n=no_act q=quiet b=backup p=parsable i=noheadings J=json o=offset t=types O=output"
    ),
    long=_long("all force no-act quiet backup parsable noheadings json offset types output"),
    short_args=frozenset("otO"),
    long_args=_names("offset types output"),
    writes="operands",
    writes_unless=_names("no_act"),
)
_BLKDISCARD = ProgramSpec(
    short=_short("o=offset l=length s=secure z=zeroout f=force v=verbose p=step q=quiet"),
    long=_long("offset length secure zeroout force verbose step quiet"),
    short_args=frozenset("olp"),
    long_args=_names("offset length step"),
    writes="operands",
)
_PARTITION = ProgramSpec(
    short=_short(
        "l=list d=dump p=print s=size b=sector_size c=compatibility u=units t=type w=wipe W=wipe_partitions "
        "L=color C=cylinders H=heads S=sectors x=extra n=no_act"
    ),
    long=_long("list dump print show-size=size sector-size type wipe wipe-partitions color no-act"),
    short_args=frozenset("btwWCHS"),
    short_optargs=frozenset("cuL"),
    long_args=_names("sector-size type wipe wipe-partitions"),
    operands="pathlike",
    writes="operands",
    writes_unless=_names("list dump print size no_act"),
)
_TRUNCATE = ProgramSpec(
    short=_short("c=no_create o=io_blocks r=reference s=size"),
    long=_long("no-create io-blocks reference size"),
    short_args=frozenset("rs"),
    long_args=_names("reference size"),
    path_flags=_names("reference"),
    writes="operands",
)
_TOUCH = ProgramSpec(
    short=_short(
        "a=access c=no_create d=date f=ignored h=no_dereference m=modification r=reference t=stamp"
    ),
    long=_long("no-create date no-dereference reference time"),
    short_args=frozenset("drt"),
    long_args=_names("date reference time"),
    path_flags=_names("reference"),
    writes="operands",
)
_MKDIR = ProgramSpec(
    short=_short("p=parents v=verbose m=mode Z=context"),
    long=_long("parents verbose mode context"),
    short_args=frozenset("m"),
    long_args=_names("mode"),
    writes="operands",
)
_RMDIR = ProgramSpec(
    short=_short("p=parents v=verbose"),
    long=_long("parents verbose ignore-fail-on-non-empty"),
    writes="operands",
)
_TEE = ProgramSpec(
    short=_short("a=append i=ignore_interrupts p=output_error"),
    long=_long("append ignore-interrupts output-error"),
    writes="operands",
)
_CP = ProgramSpec(
    short=_short(
        "rR=recursive a=archive f=force i=interactive n=no_clobber v=verbose p=preserve l=link "
        "s=symbolic_link u=update x=one_file_system d=no_dereference_preserve L=dereference "
        "P=no_dereference H=dereference_args b=backup T=no_target_directory t=target_directory S=suffix"
    ),
    long=_long(
        "recursive archive force interactive no-clobber verbose preserve no-preserve parents link "
        "symbolic-link update one-file-system dereference no-dereference backup "
        "no-target-directory target-directory suffix remove-destination sparse reflink "
        "attributes-only copy-contents strip-trailing-slashes debug"
    ),
    short_args=frozenset("tS"),
    long_args=_names("target-directory suffix"),
    write_flags=_names("target_directory"),
    writes="last",
)
_MV = ProgramSpec(
    short=_short(
        "f=force i=interactive n=no_clobber v=verbose u=update b=backup T=no_target_directory "
        "t=target_directory S=suffix Z=context"
    ),
    long=_long(
        "force interactive no-clobber verbose update backup no-target-directory target-directory "
        "suffix strip-trailing-slashes exchange no-copy context debug"
    ),
    short_args=frozenset("tS"),
    long_args=_names("target-directory suffix"),
    write_flags=_names("target_directory"),
    # Moving a file away changes its source as much as its destination.
    writes="operands",
)
_LN = ProgramSpec(
    short=_short(
        "s=symbolic f=force n=no_dereference v=verbose r=relative b=backup T=no_target_directory "
        "t=target_directory i=interactive L=logical P=physical S=suffix"
    ),
    long=_long(
        "symbolic force no-dereference verbose relative backup no-target-directory "
        "target-directory interactive logical physical suffix"
    ),
    short_args=frozenset("tS"),
    long_args=_names("target-directory suffix"),
    write_flags=_names("target_directory"),
    writes="last",
)
_INSTALL = ProgramSpec(
    short=_short(
        "b=backup c=ignored C=compare d=directory D=create_leading g=group m=mode o=owner "
        "p=preserve_timestamps s=strip S=suffix t=target_directory T=no_target_directory v=verbose"
    ),
    long=_long(
        "backup compare directory group mode owner preserve-timestamps strip strip-program suffix "
        "target-directory no-target-directory verbose"
    ),
    short_args=frozenset("gmoSt"),
    long_args=_names("group mode owner strip-program suffix target-directory"),
    write_flags=_names("target_directory"),
    writes="last",
)
_SED = ProgramSpec(
    short=_short(
        "n=quiet e=expression f=file i=in_place E=extended r=extended s=separate u=unbuffered "
        "z=null_data l=line_length b=binary"
    ),
    long=_long(
        "quiet silent=quiet expression file in-place line-length null-data zero-terminated=null_data "
        "regexp-extended=extended separate unbuffered posix debug sandbox follow-symlinks binary"
    ),
    short_args=frozenset("efl"),
    short_optargs=frozenset("i"),
    long_args=_names("expression file line-length"),
    skip_first_unless=_names("expression file"),
    path_flags=_names("file"),
    writes="operands",
    writes_if=_names("in_place"),
)
_CURL = ProgramSpec(
    short=_short(
        "o=output O=remote_name X=request d=data H=header u=user x=proxy T=upload_file k=insecure "
        "L=location s=silent S=show_error f=fail F=form A=user_agent e=referer b=cookie "
        "c=cookie_jar m=max_time K=config E=cert w=write_out r=range C=continue_at U=proxy_user "
        "D=dump_header I=head i=include v=verbose G=get N=no_buffer n=netrc Q=quote t=telnet_option "
        "y=speed_time Y=speed_limit z=time_cond P=ftp_port J=remote_header_name Z=parallel g=globoff "
        "4=ipv4 6=ipv6 q=disable R=remote_time"
    ),
    long=_long(
        "output remote-name request data data-binary data-raw data-urlencode data-ascii header user "
        "proxy upload-file insecure location silent show-error fail form form-string user-agent "
        "referer cookie cookie-jar max-time connect-timeout config cert key cacert capath write-out "
        "range continue-at proxy-user dump-header retry retry-delay retry-max-time limit-rate "
        "output-dir resolve connect-to interface max-filesize url trace trace-ascii stderr "
        "oauth2-bearer json max-redirs unix-socket abstract-unix-socket netrc-file pass proto "
        "proto-redir preproxy proxy-header quote request-target socks4 socks4a socks5 "
        "socks5-hostname head include verbose get compressed create-dirs remote-header-name "
        "parallel globoff ipv4 ipv6 http1.1 http2 fail-with-body location-trusted"
    ),
    short_args=frozenset("oXdHuxTFAebcmKEwrCUDQtyYzP"),
    long_args=_names(
        "output request data data-binary data-raw data-urlencode data-ascii header user proxy "
        "upload-file form form-string user-agent referer cookie cookie-jar max-time "
        "connect-timeout config cert key cacert capath write-out range continue-at proxy-user "
        "dump-header retry retry-delay retry-max-time limit-rate output-dir resolve connect-to "
        "interface max-filesize url trace trace-ascii stderr oauth2-bearer json max-redirs "
        "unix-socket abstract-unix-socket netrc-file pass proto proto-redir preproxy proxy-header "
        "quote request-target socks4 socks4a socks5 socks5-hostname"
    ),
    operands="none",
    write_flags=_names("output cookie_jar dump_header output_dir trace trace_ascii stderr"),
    path_flags=_names("upload_file config cert key cacert netrc_file unix_socket"),
)
_WGET = ProgramSpec(
    short=_short(
        "O=output_document o=output_file a=append_output P=directory_prefix i=input_file e=execute "
        "U=user_agent t=tries T=timeout w=wait l=level A=accept R=reject D=domains "
        "X=exclude_directories I=include_directories B=base Q=quota n=no q=quiet v=verbose "
        "c=continue N=timestamping r=recursive m=mirror p=page_requisites k=convert_links "
        "S=server_response b=background x=force_directories E=adjust_extension F=force_html "
        "H=span_hosts K=backup_converted L=relative h=help V=version d=debug 4=inet4_only 6=inet6_only"
    ),
    long=_long(
        "output-document output-file append-output directory-prefix input-file execute user-agent "
        "tries timeout wait level accept reject domains exclude-directories include-directories "
        "base quota header post-data post-file body-data body-file method user password "
        "http-user http-password load-cookies save-cookies quiet verbose continue timestamping "
        "recursive mirror page-requisites convert-links no-parent no-clobber no-check-certificate "
        "background spider restrict-file-names"
    ),
    short_args=frozenset("OoaPieUtTwlARDXIBQn"),
    long_args=_names(
        "output-document output-file append-output directory-prefix input-file execute user-agent "
        "tries timeout wait level accept reject domains exclude-directories include-directories "
        "base quota header post-data post-file body-data body-file method user password "
        "http-user http-password load-cookies save-cookies restrict-file-names"
    ),
    operands="none",
    write_flags=_names("output_document output_file append_output directory_prefix save_cookies"),
    path_flags=_names("input_file post_file body_file load_cookies"),
)
# sort and tree only read their operands, but `-o FILE` writes a file: without these tables a
# read-only policy would let `sort -o /etc/passwd /dev/null` through as a command that reads.
_SORT = ProgramSpec(
    short=_short(
        "o=output k=key t=field_separator S=buffer_size T=temporary_directory "
        "b=ignore_leading_blanks d=dictionary_order f=ignore_case g=general_numeric_sort "
        "i=ignore_nonprinting M=month_sort h=human_numeric_sort n=numeric_sort R=random_sort "
        "r=reverse V=version_sort c=check C=check_quiet m=merge s=stable u=unique "
        "z=zero_terminated"
    ),
    long=_long(
        "output key field-separator buffer-size temporary-directory files0-from "
        "compress-program batch-size parallel random-source sort ignore-leading-blanks "
        "dictionary-order ignore-case general-numeric-sort ignore-nonprinting month-sort "
        "human-numeric-sort numeric-sort random-sort reverse version-sort check merge stable "
        "unique zero-terminated debug"
    ),
    short_args=frozenset("oktST"),
    long_args=_names(
        "output key field-separator buffer-size temporary-directory files0-from "
        "compress-program batch-size parallel random-source sort"
    ),
    write_flags=_names("output"),
    path_flags=_names("files0_from random_source temporary_directory"),
)
_TREE = ProgramSpec(
    short=_short("o=output L=level P=pattern I=ignore H=html_base T=title"),
    long=_long("charset filelimit timefmt sort gitfile infofile hintro houtro"),
    short_args=frozenset("oLPIHT"),
    long_args=_names("charset filelimit timefmt sort gitfile infofile hintro houtro"),
    write_flags=_names("output"),
    path_flags=_names("gitfile infofile hintro houtro"),
)
_DD = ProgramSpec(operands="none")
"""dd has no options, only ``key=value`` operands; the normalizer reads ``if=`` and ``of=``."""

PROGRAMS: Final[Mapping[str, ProgramSpec]] = {
    "rm": _RM,
    "unlink": ProgramSpec(writes="operands"),
    "rmdir": _RMDIR,
    "chmod": _CHMOD,
    "chown": _CHOWN,
    "chgrp": _CHOWN,
    "dd": _DD,
    "mkfs": _MKFS,
    "mke2fs": _MKFS,
    "mkswap": _MKFS,
    "mkdosfs": _MKFS,
    "mkntfs": _MKFS,
    "shred": _SHRED,
    "wipefs": _WIPEFS,
    "blkdiscard": _BLKDISCARD,
    "fdisk": _PARTITION,
    "sfdisk": _PARTITION,
    "cfdisk": _PARTITION,
    "sgdisk": _PARTITION,
    "gdisk": _PARTITION,
    "parted": _PARTITION,
    "truncate": _TRUNCATE,
    "touch": _TOUCH,
    "mkdir": _MKDIR,
    "tee": _TEE,
    "cp": _CP,
    "mv": _MV,
    "ln": _LN,
    "install": _INSTALL,
    "sed": _SED,
    "curl": _CURL,
    "wget": _WGET,
    "sort": _SORT,
    "tree": _TREE,
}
"""Programs with a flag table. ``mkfs.ext4``, ``mkfs.vfat``... use the ``mkfs`` entry."""


def spec_for(program: str) -> ProgramSpec | None:
    """The flag table for a program basename, if it has one."""
    spec = PROGRAMS.get(program)
    if spec is None and program.startswith("mkfs."):
        return _MKFS
    return spec
