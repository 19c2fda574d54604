"""Build the cluster's binaries from the Go module proxy into a versioned cache outside the repository.

Why build at all: these machines have no container engine and no registry ships Kubernetes binaries, but the
Go module proxy serves the source of every component. Each Go project (Kubernetes, etcd, kwok, helm, Prometheus)
is built in its own throw-away main module generated from `gomod/<name>/go.mod.tmpl`, so their dependency graphs
never have to agree with each other.

Layout under the cache root (`$PDSERVE_CACHE_DIR`, default `~/.cache/pdserve`), one directory per toolset
(`versions.TOOLSETS`: `k8s` for the cluster, `prometheus` for prometheus and promtool):

    <toolset>/<cache key>/bin/<binary>         the results
    <toolset>/<cache key>/manifest.json        what was built, with which Go, how long it took
    <toolset>/<cache key>/src/<module>/go.mod  the generated main modules
    go/mod, go/build                           GOMODCACHE and GOCACHE, shared by every key so CI can keep them

A toolset's cache key (`versions.cache_key(toolset)`) changes only when one of its pins or templates changes; a
binary already in `bin/` is never rebuilt. Binaries are written to a temporary name and renamed, so an
interrupted build leaves no half-written executable behind, and a file lock serialises concurrent builders (a
test run and a CLI call).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import string
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pdserve_dev.cluster import versions

MINIMUM_GO = (1, 26)
"""k8s.io/kubernetes v1.37 and etcd v3.6.16 declare `go 1.26.0` in their go.mod."""

CLUSTER_BINARIES: tuple[str, ...] = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kwok",
    "kubectl",
)
"""What `up` needs; helm is built too but a cluster can run without it."""

PROMETHEUS_BINARIES: tuple[str, ...] = ("prometheus",)
"""What `up --prometheus` and the `prometheus` test fixture need (promtool is built too, for checking configs)."""

# Lines of `go` output that mean the module proxy (or checksum database) refused a module, as opposed to a
# compile error. Used only to phrase the error message.
_REFUSED = re.compile(
    r"(404 Not Found|410 Gone|unknown revision|invalid version|no matching versions|"
    r"module lookup disabled|not found: |"
    r"verifying module|SECURITY ERROR|dial tcp|i/o timeout|connection refused)"
)


class BuildError(RuntimeError):
    """A binary could not be built; the message names the component and the reason."""


def cache_root() -> Path:
    """Root of everything cached outside the repository."""
    configured = os.environ.get("PDSERVE_CACHE_DIR")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "pdserve"


def version_dir(key: str | None = None, toolset: versions.Toolset = versions.KUBERNETES) -> Path:
    """The directory of one pinned set of versions of `toolset`."""
    return cache_root() / toolset.name / (key or versions.cache_key(toolset))


def bin_dir(key: str | None = None, toolset: versions.Toolset = versions.KUBERNETES) -> Path:
    """Where the binaries of the current pins of `toolset` live."""
    return version_dir(key, toolset) / "bin"


def _toolset_of(name: str) -> versions.Toolset:
    try:
        return versions.toolset_of(name)
    except KeyError:
        raise BuildError(f"Unknown binaries {[name]}; known: {list(versions.ALL_BINARIES)}") from None


def _binary_path(name: str) -> Path:
    return bin_dir(toolset=_toolset_of(name)) / name


def missing_binaries(names: Sequence[str] = versions.ALL_BINARIES) -> list[str]:
    """Binaries of the current pins that are not built yet."""
    return [name for name in names if not os.access(_binary_path(name), os.X_OK)]


def binary(name: str) -> Path:
    """Path of one built binary; raise with the fix if it is missing."""
    path = _binary_path(name)
    if not os.access(path, os.X_OK):
        raise BuildError(f"{name} is not built yet (expected {path}); run `pdserve dev cluster build`")
    return path


@dataclass
class BinaryResult:
    """Outcome of one `go build`."""

    name: str
    package: str
    seconds: float
    size_bytes: int = 0
    error: str | None = None
    cached: bool = False


@dataclass
class ToolsetBuild:
    """One toolset's part of a build: what its manifest.json records."""

    toolset: str
    key: str
    bin_dir: str
    go_version: str
    pins: dict[str, str]
    results: list[BinaryResult] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class BuildReport:
    """Everything `pdserve dev cluster build` prints: one entry per toolset that had something to do."""

    go_version: str
    toolsets: list[ToolsetBuild] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def results(self) -> list[BinaryResult]:
        return [r for toolset in self.toolsets for r in toolset.results]

    @property
    def failed(self) -> list[BinaryResult]:
        return [r for r in self.results if r.error is not None]

    def disk_usage(self) -> dict[str, int]:
        """Bytes used by the binaries of the built keys and by the shared Go caches (for the README)."""
        return _disk_usage([Path(t.bin_dir) for t in self.toolsets])


def _disk_usage(bin_dirs: Sequence[Path]) -> dict[str, int]:
    root = cache_root()
    return {
        "bin": sum(_tree_size(path) for path in bin_dirs),
        "gomodcache": _tree_size(root / "go" / "mod"),
        "gocache": _tree_size(root / "go" / "build"),
    }


def _tree_size(path: Path) -> int:
    total = 0
    for dirpath, _dirnames, filenames in os.walk(path):
        for filename in filenames:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, filename)).st_size
    return total


def go_env() -> dict[str, str]:
    """Environment for every `go` call: caches under the cache root, static binaries, module mode."""
    root = cache_root()
    env = dict(os.environ)
    env["GOMODCACHE"] = str(root / "go" / "mod")
    env["GOCACHE"] = str(root / "go" / "build")
    env["CGO_ENABLED"] = "0"
    # -mod=mod lets `go build` complete go.sum from the proxy; -buildvcs=false because the generated module
    # directory is not a repository and VCS stamping would only add noise.
    flags = env.get("GOFLAGS", "").split()
    for flag in ("-mod=mod", "-buildvcs=false"):
        if flag not in flags:
            flags.append(flag)
    env["GOFLAGS"] = " ".join(flags)
    return env


def check_go() -> tuple[Path, str]:
    """Find the Go toolchain and check its version; raise a BuildError that says what is missing."""
    go = shutil.which("go")
    if go is None:
        need = f"go{MINIMUM_GO[0]}.{MINIMUM_GO[1]}"
        raise BuildError(
            f"The Go toolchain (`go`, version >= {need}) is not on PATH; it is needed to build kube-apiserver, "
            "etcd, kwok, kubectl and helm from the Go module proxy"
        )
    try:
        out = subprocess.run(
            [go, "env", "GOVERSION"], capture_output=True, text=True, check=True, timeout=60
        ).stdout.strip()
    except (subprocess.SubprocessError, OSError) as exc:
        raise BuildError(f"`{go} env GOVERSION` failed: {exc}") from exc
    match = re.match(r"go(\d+)\.(\d+)", out)
    if match is None or (int(match[1]), int(match[2])) < MINIMUM_GO:
        raise BuildError(
            f"Go {out or 'of unknown version'} at {go} is too old; need go{MINIMUM_GO[0]}.{MINIMUM_GO[1]}+"
        )
    return Path(go), out


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock file for the duration of a build (another builder waits, then finds the work done)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def go_binary(
    target: Path,
    *,
    source: Path,
    what: str,
    package: str = ".",
    lock: Path | None = None,
    env: dict[str, str] | None = None,
    prepare: Callable[[], None] | None = None,
    log: Callable[[str], None] = print,
) -> Path:
    """`target`, built now by `go build <package>` in `source` unless it is there (the dev tools that are one Go
    binary each: kstatus-check, lwepp, the picker relay). Under a lock (`lock`, else one beside `target`): another
    builder waits, then finds it built. Into a partial file renamed into place: a killed build leaves nothing that
    looks built. `prepare` writes the sources first, under the lock; `what` names the package in the log and in a
    failure (`BuildError`, saying which module the proxy refused when it did)."""
    if os.access(target, os.X_OK):
        return target
    go, _ = check_go()
    with _locked(lock or target.parent / ".build.lock"):
        if os.access(target, os.X_OK):  # another builder finished while we waited
            return target
        if prepare is not None:
            prepare()
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.parent / f".{target.name}.partial"
        log(f"  {target.name:<24} building {what} ...")
        started = time.monotonic()
        proc = subprocess.run(
            [str(go), "build", "-trimpath", "-ldflags=-s -w", "-o", str(partial), package],
            cwd=source,
            env=env if env is not None else go_env(),
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            partial.unlink(missing_ok=True)
            raise BuildError(_explain_failure(target.name, what, proc.stderr))
        partial.replace(target)
        log(f"  {target.name:<24} built in {time.monotonic() - started:6.1f}s")
    return target


def _explain_failure(name: str, package: str, stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    refused = [line for line in lines if _REFUSED.search(line)]
    if refused:
        # `go: downloading <module> <version>` lines name what was being fetched when the proxy said no.
        fetching = [line.split("downloading", 1)[1].strip() for line in lines if "go: downloading" in line]
        module = f" (while fetching {fetching[-1]})" if fetching else ""
        return (
            f"the Go module proxy did not provide a module needed for {name} ({package}){module}: {refused[0].strip()}"
        )
    tail = "\n    ".join(lines[-15:])
    return f"`go build {package}` failed:\n    {tail}"


def build(
    names: Sequence[str] | None = None,
    *,
    force: bool = False,
    log: Callable[[str], None] = print,
) -> BuildReport:
    """Build the requested binaries (default: all) that are not cached yet; return what happened.

    A failure of one binary does not stop the others: the report lists each outcome, and the caller decides
    whether what is missing matters (`ensure_binaries` raises only for binaries it needs).
    """
    go, go_version = check_go()
    wanted = set(names or versions.ALL_BINARIES)
    unknown = wanted - set(versions.ALL_BINARIES)
    if unknown:
        raise BuildError(f"Unknown binaries {sorted(unknown)}; known: {list(versions.ALL_BINARIES)}")
    report = BuildReport(go_version=go_version)
    started = time.monotonic()
    for toolset in versions.TOOLSETS:
        todo = [name for name in toolset.binaries if name in wanted]
        if todo:
            report.toolsets.append(_build_toolset(toolset, todo, go, go_version, force=force, log=log))
    report.seconds = time.monotonic() - started
    return report


def _build_toolset(
    toolset: versions.Toolset,
    wanted: Sequence[str],
    go: Path,
    go_version: str,
    *,
    force: bool,
    log: Callable[[str], None],
) -> ToolsetBuild:
    key = versions.cache_key(toolset)
    root = version_dir(key, toolset)
    out_dir = root / "bin"
    values = toolset.values()
    report = ToolsetBuild(
        toolset=toolset.name,
        key=key,
        bin_dir=str(out_dir),
        go_version=go_version,
        pins={k: v for k, v in values.items() if k.endswith("_version")},
    )
    started = time.monotonic()
    env = go_env()
    with _locked(root / ".build.lock"):
        out_dir.mkdir(parents=True, exist_ok=True)
        for module in toolset.modules:
            todo = [b for b in module.binaries if b in wanted]
            if not todo:
                continue
            src = root / "src" / module.name
            src.mkdir(parents=True, exist_ok=True)
            (src / "go.mod").write_text(string.Template(versions.read_template(module.name)).substitute(values))
            # The checked-in go.sum pins the content hash of every module of the current pins, so a build on a
            # new machine verifies downloads against what was built here; -mod=mod adds lines after a pin bump.
            known_sums = versions.read_go_sum(module.name)
            if known_sums:
                (src / "go.sum").write_text(known_sums)
            tags = [f"-tags={','.join(module.tags)}"] if module.tags else []
            mismatch: str | None = None
            for name in todo:
                package = module.binaries[name]
                target = out_dir / name
                if target.exists() and not force:
                    report.results.append(BinaryResult(name, package, 0.0, target.stat().st_size, cached=True))
                    log(f"  {name:<24} cached   {target}")
                    continue
                mismatch = mismatch or _check_resolved_pins(go, module.name, src, env)
                if mismatch:
                    report.results.append(BinaryResult(name, package, 0.0, error=mismatch))
                    log(f"  {name:<24} FAILED: {mismatch}")
                    continue
                log(f"  {name:<24} building {package} ...")
                t0 = time.monotonic()
                tmp = out_dir / f".{name}.partial"
                proc = subprocess.run(
                    [
                        str(go),
                        "build",
                        "-trimpath",
                        *tags,
                        f"-ldflags={' '.join(versions.ldflags(module.name))}",
                        "-o",
                        str(tmp),
                        package,
                    ],
                    cwd=src,
                    env=env,
                    capture_output=True,
                    text=True,
                    check=False,
                )
                seconds = time.monotonic() - t0
                if proc.returncode != 0:
                    tmp.unlink(missing_ok=True)
                    error = _explain_failure(name, package, proc.stderr)
                    report.results.append(BinaryResult(name, package, seconds, error=error))
                    log(f"  {name:<24} FAILED after {seconds:.0f}s: {error}")
                    continue
                tmp.replace(target)
                size = target.stat().st_size
                report.results.append(BinaryResult(name, package, seconds, size))
                log(f"  {name:<24} built in {seconds:6.1f}s ({size / 2**20:.0f} MiB)")
        report.seconds = time.monotonic() - started
        if any(not r.cached for r in report.results):
            _update_manifest(root / "manifest.json", report)
    return report


def _check_resolved_pins(go: Path, module: str, src: Path, env: dict[str, str]) -> str | None:
    """None when every dependency `versions.RESOLVED_PINS` names for `module` resolves to its pin (the ldflags are
    derived from those pins); otherwise what differs and which pin to update."""
    for path, pinned in versions.RESOLVED_PINS.get(module, {}).items():
        proc = subprocess.run(
            [str(go), "list", "-m", "-f", "{{.Version}}", path],
            cwd=src,
            env=env,
            capture_output=True,
            text=True,
            check=False,
            timeout=600,
        )
        if proc.returncode != 0:
            return f"`go list -m {path}` for {module} failed: {proc.stderr.strip()[-800:]}"
        resolved = proc.stdout.strip()
        if resolved != pinned():
            return (
                f"{module} builds with {path} {resolved}, but its version stamps are derived from the pin "
                f"{pinned()} (pdserve_dev/cluster/versions.py): update the pin"
            )
    return None


def _update_manifest(path: Path, report: ToolsetBuild) -> None:
    """Record this build in manifest.json, keeping earlier entries of binaries that were cached this time.

    The manifest is the record of how long each binary took to build cold, which a later all-cached run
    must not overwrite with zeros.
    """
    manifest = asdict(report)
    with contextlib.suppress(OSError, ValueError):
        previous = {r["name"]: r for r in json.loads(path.read_text()).get("results", [])}
        manifest["results"] = [previous.get(r["name"], r) if r["cached"] else r for r in manifest["results"]]
    manifest["disk_usage"] = _disk_usage([Path(report.bin_dir)])
    path.write_text(json.dumps(manifest, indent=2) + "\n")


def prune_go_build_cache() -> None:
    """Delete GOCACHE (compiled packages). Binaries and the module cache stay; only a rebuild gets slower."""
    shutil.rmtree(cache_root() / "go" / "build", ignore_errors=True)


def ensure_binaries(names: Sequence[str] = CLUSTER_BINARIES, *, log: Callable[[str], None] = print) -> Path:
    """Build whatever of `names` is missing; return the bin directory of the first name's toolset, or raise naming
    what could not be built."""
    toolset = _toolset_of(names[0]) if names else versions.KUBERNETES
    missing = missing_binaries(names)
    if missing:
        log(f"Building missing binaries {missing} (first time: 10-20 minutes on 2 cores)")
        report = build(missing, log=log)
        failed = [r for r in report.failed if r.name in names]
        if failed:
            raise BuildError("; ".join(f"{r.name}: {r.error}" for r in failed))
    return bin_dir(toolset=toolset)
