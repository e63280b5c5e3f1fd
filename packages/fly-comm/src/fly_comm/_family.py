"""Registration of fly-comm with the ``flydsl`` CLI (entry point ``flydsl.families: comm``).

Cheap to import: it describes the family only. No demo case: an all-reduce needs a process group of
several ranks, which ``flydsl demo`` (one process) does not have; ``flydsl bench comm`` starts its own.
"""

from __future__ import annotations

from flydsl.families import Family

from ._version import __version__


def _bench(argv) -> int:
    from .bench import main

    return main(list(argv))


FAMILY = Family(
    name="comm",
    distribution="fly-comm",
    module="fly_comm",
    version=__version__,
    description="custom all-reduce across the GPUs of one host (one-shot, two-shot, NCCL)",
    bench=_bench,
)
