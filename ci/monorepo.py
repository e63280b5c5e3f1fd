"""The packages of this monorepo and how they depend on each other: the one list.

``noxfile.py`` generates its sessions from :data:`PACKAGES`, and
``ci/changed_packages.py`` maps changed paths to packages with it. Standard
library only, so both can import it from any interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Package", "PACKAGES", "by_name", "by_folder", "install_order", "dependents", "names"]


@dataclass(frozen=True)
class Package:
    name: str  # short name used in session names and CI: "norm"
    folder: str  # folder under packages/
    distribution: str  # the PyPI name
    module: str  # the import name
    depends: tuple[str, ...] = ()  # our packages it needs, by short name, lowest layer first
    gpu: bool = True  # a kernel family: flydsl.families entry point and bench- session (the runtime has no kernels)
    shard: bool = True  # has gpu-marked tests, a gpu-<name> session and GPU CI shards (ci/matrix.toml)

    @property
    def path(self) -> str:
        """The package folder, relative to the repository root."""
        return f"packages/{self.folder}"


# Lowest layer first: an install or test of a package needs only what precedes it.
PACKAGES: tuple[Package, ...] = (
    Package("runtime", "flydsl-runtime", "flydsl-runtime", "flydsl", (), gpu=False),
    # The folder keeps its name, but the PyPI name `fly-common` belongs to an unrelated project.
    Package("common", "fly-common", "flydsl-common", "flydsl_common", ("runtime",)),
    Package("norm", "fly-norm", "fly-norm", "fly_norm", ("runtime", "common")),
    Package("gemm", "fly-gemm", "fly-gemm", "fly_gemm", ("runtime", "common")),
    Package("attention", "fly-attention", "fly-attention", "fly_attention", ("runtime", "common")),
    Package("conv", "fly-conv", "fly-conv", "fly_conv", ("runtime", "common")),
    Package("comm", "fly-comm", "fly-comm", "fly_comm", ("runtime", "common")),
)


def names() -> list[str]:
    return [p.name for p in PACKAGES]


def by_name(name: str) -> Package:
    for p in PACKAGES:
        if p.name == name:
            return p
    raise KeyError(f"unknown package {name!r}; known: {', '.join(names())}")


def by_folder(folder: str) -> Package | None:
    for p in PACKAGES:
        if p.folder == folder:
            return p
    return None


def install_order(name: str) -> list[Package]:
    """The package and every package of ours it needs, lowest layer first."""
    wanted: set[str] = set()

    def visit(n: str) -> None:
        if n not in wanted:
            wanted.add(n)
            for d in by_name(n).depends:
                visit(d)

    visit(name)
    return [p for p in PACKAGES if p.name in wanted]


def dependents(name: str) -> list[Package]:
    """The package and every package that needs it, directly or not (what a change to it can break)."""
    return [p for p in PACKAGES if any(q.name == name for q in install_order(p.name))]
