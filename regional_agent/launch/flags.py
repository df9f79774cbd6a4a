"""The elastic launcher's flags, spelled the way the installed ``torch.distributed.run`` accepts.

torch adds, renames and drops launcher options between releases (``--shutdown-timeout``
exists in 2.13 and not in 2.11; older releases spell some options only with
underscores). Rather than assume a version, :func:`installed_options` asks the installed
torch's own parser which option strings it knows, and :func:`spell_flags` picks each
flag's spelling: an optional flag the parser lacks is dropped, a required one is an
error that names it.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Sequence
from dataclasses import dataclass


class MissingLauncherFlag(ValueError):
    """The installed ``torch.distributed.run`` lacks an option the launcher cannot do without."""


@dataclass(frozen=True, slots=True)
class Flag:
    """One option of the launcher's command line, by its hyphenated name."""

    name: str
    """e.g. ``nproc-per-node``; the underscore spelling is tried when the hyphen one is unknown."""
    required: bool = True
    """False: the group runs (with torch's default) when the installed torch lacks it."""


@dataclass(frozen=True, slots=True)
class FlagSpelling:
    """What :func:`spell_flags` decided."""

    spelled: dict[str, str]
    """Flag name -> the option string the installed parser knows."""
    dropped: tuple[str, ...]
    """Optional flags the installed parser lacks, left out of the command line."""


def spell_flags(flags: Sequence[Flag], accepted: Collection[str]) -> FlagSpelling:
    """Spell ``flags`` among the ``accepted`` option strings (``--name`` or ``--na_me``)."""
    spelled: dict[str, str] = {}
    dropped: list[str] = []
    for flag in flags:
        candidates = (f"--{flag.name}", f"--{flag.name.replace('-', '_')}")
        known = [option for option in candidates if option in accepted]
        if known:
            spelled[flag.name] = known[0]
        elif flag.required:
            raise MissingLauncherFlag(
                f"the installed torch.distributed.run has no --{flag.name} option, which the "
                "worker group needs; install a torch that geofed supports (see README)"
            )
        else:
            dropped.append(flag.name)
    return FlagSpelling(spelled, tuple(dropped))


@functools.cache
def installed_options() -> frozenset[str]:
    """Every option string of the installed ``torch.distributed.run`` parser (built once)."""
    from torch.distributed.run import get_args_parser

    # argparse keeps no public list of its options; this mapping holds every spelling.
    return frozenset(get_args_parser()._option_string_actions)
