"""Make torchair's real Python sources importable on a machine without CANN.

torchair ships inside the torch_npu wheel (``torch_npu/dynamo/torchair``).
Installing torch_npu is not an option here (it makes ``import torch`` fail
without CANN), so :func:`load_torchair`:

1. downloads the torch_npu wheel matching the installed torch with
   ``pip download --no-deps`` (once; the wheel is kept under ``<cache>/wheels``,
   see :func:`cache_root` and :func:`wheel_file`): the newest post release of the
   torch_npu line of the installed torch (torch 2.7.1 -> torch_npu 2.7.1.post11),
   which is what users of that line install, or an exact version when asked;
2. unpacks only ``torch_npu/dynamo/torchair/**`` (its Python files and data, not
   its compiled extension modules) into ``<cache>/torchair-<line>-newest/torchair``
   and byte-compiles it;
3. imports ``<that directory>/torchair`` as the top-level package ``torchair``
   (how its own sources refer to themselves: ``import torchair.x`` resolves
   through the package's ``__path__``), without putting the directory on
   ``sys.path``, with an import hook that serves torchair's four CANN-facing
   extension modules from :mod:`.cann_stub`.

:func:`contract_sources` reads, from the same cached wheel, what the NPU-side
contract check (:mod:`npu_contracts`) compares our code with: torch_npu's op
schemas, its eager kernel's accepted ``rotary_mode`` values and torchair's
generated GE op definitions.

Environment:

* ``NPU_FUSION_TORCH_NPU_VERSION``: the exact torch_npu version to use (default:
  the newest release of the installed torch's line, ``2.13.0+cpu`` -> ``2.13.0.*``).
* ``NPU_FUSION_TORCH_NPU_WHEEL``: a local torch_npu wheel to unpack instead of
  downloading one.
* ``NPU_FUSION_CACHE_DIR``: the cache directory (default
  ``$XDG_CACHE_HOME/npu_fusion`` or ``~/.cache/npu_fusion``).
"""
from __future__ import annotations

import compileall
import contextlib
import json
import re
import importlib.abc
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import warnings
import zipfile
from pathlib import Path
from typing import Optional

from . import cann_stub

WHEEL_PREFIX = "torch_npu/dynamo/torchair/"
#: pip messages that mean the package index could not be reached at all.
_NETWORK_ERRORS = (
    "Could not fetch URL", "Max retries exceeded", "NewConnectionError", "Temporary failure in name resolution",
    "Name or service not known", "Network is unreachable", "Connection refused", "ProxyError", "timed out",
    "ConnectTimeoutError", "ReadTimeoutError", "SSLError", "No route to host",
)


#: pip messages that mean the index was reached but has no such torch_npu (torch is newer than
#: every torch_npu release, as torch 2.15.0 is at present).
_NOT_PUBLISHED = ("No matching distribution found", "Could not find a version that satisfies")


class TorchairUnavailable(Exception):
    """torchair could not be obtained; ``offline`` is True when the package index was unreachable,
    ``unpublished`` when it has no torch_npu for this torch."""

    def __init__(self, message: str, *, offline: bool, unpublished: bool = False):
        super().__init__(message)
        self.offline = offline
        self.unpublished = unpublished


def torch_npu_version() -> str:
    """The exact torch_npu version asked for, or the installed torch's line (``2.7.1``)."""
    override = os.environ.get("NPU_FUSION_TORCH_NPU_VERSION")
    if override:
        return override
    import torch

    return torch.__version__.split("+")[0]


def torch_npu_requirement() -> str:
    """What pip is asked for: an exact override as given, else the newest post release
    of the line (``==2.7.1.*`` matches 2.7.1.post11; prereleases are not taken)."""
    version = torch_npu_version()
    return f"torch-npu=={version}" if os.environ.get("NPU_FUSION_TORCH_NPU_VERSION") else f"torch-npu=={version}.*"


def cache_key() -> str:
    """The cache directory's name: the line's newest release and an exact version never share one."""
    suffix = "" if os.environ.get("NPU_FUSION_TORCH_NPU_VERSION") else "-newest"
    return f"torchair-{torch_npu_version()}{suffix}"


def cache_root() -> Path:
    override = os.environ.get("NPU_FUSION_CACHE_DIR")
    if override:
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "npu_fusion"


@contextlib.contextmanager
def _locked(path: Path):
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _download_wheel(spec: str, dest: Path) -> Path:
    base = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", "--no-input", "--retries", "2", "--dest", str(dest)]
    # The wheel's Python files are the same on every platform; when none is
    # published for this interpreter and platform, take a manylinux x86_64 one.
    python = f"{sys.version_info.major}{sys.version_info.minor}"
    attempts = [base + [spec]] + [base + ["--platform", platform, "--python-version", python, spec]
                                  for platform in ("manylinux_2_28_x86_64", "manylinux2014_x86_64")]
    output = ""
    for command in attempts:
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=900)
        except subprocess.TimeoutExpired as error:
            raise TorchairUnavailable(f"`pip download {spec}` timed out: {error}", offline=True) from error
        output += done.stdout + done.stderr
        wheels = sorted(dest.glob("torch_npu-*.whl"))
        if done.returncode == 0 and wheels:
            return wheels[0]
        offline = any(marker in output for marker in _NETWORK_ERRORS)
        if offline:
            break
    tail = "\n".join(output.strip().splitlines()[-15:])
    unpublished = not offline and any(marker in output for marker in _NOT_PUBLISHED)
    raise TorchairUnavailable(f"could not download {spec} (the wheel that carries torchair) with pip:\n{tail}",
                              offline=offline, unpublished=unpublished)


def _unpack(wheel: Path, target: Path) -> int:
    """Unpack torchair's files but not its compiled extension modules."""
    count = 0
    with zipfile.ZipFile(wheel) as archive:
        for info in archive.infolist():
            name = info.filename
            if not name.startswith(WHEEL_PREFIX) or info.is_dir() or name.endswith((".so", ".pyd", ".dll")):
                continue
            relative = name[len("torch_npu/dynamo/"):]
            out = target / relative
            out.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(info) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst)
            count += 1
    if not (target / "torchair" / "__init__.py").exists():
        raise TorchairUnavailable(f"{wheel.name} has no {WHEEL_PREFIX}__init__.py", offline=False)
    return count


def wheel_file(version: Optional[str] = None) -> Path:
    """The torch_npu wheel of an exact ``version``, or (None) the newest release of the installed
    torch's line (:func:`torch_npu_requirement`): ``NPU_FUSION_TORCH_NPU_WHEEL``, else the one
    kept under ``<cache>/wheels``, downloaded there first if it is not yet."""
    local = os.environ.get("NPU_FUSION_TORCH_NPU_WHEEL")
    if local:
        return Path(local)
    wheels = cache_root() / "wheels" / (cache_key() if version is None else "exact")
    pattern = "torch_npu-*.whl" if version is None else f"torch_npu-{version}-*.whl"
    spec = torch_npu_requirement() if version is None else f"torch-npu=={version}"
    cached = sorted(wheels.glob(pattern))
    if cached:
        return cached[0]
    with _locked(cache_root() / f".wheel-{wheels.name}-{version}.lock"):
        cached = sorted(wheels.glob(pattern))
        if cached:
            return cached[0]
        with tempfile.TemporaryDirectory(prefix="torch_npu-download-", dir=cache_root()) as tmp:
            downloaded = _download_wheel(spec, Path(tmp))
            wheels.mkdir(parents=True, exist_ok=True)
            return Path(shutil.move(str(downloaded), str(wheels / downloaded.name)))


def ensure_torchair_sources(version: Optional[str] = None) -> Path:
    """The directory that holds the unpacked ``torchair/``, unpacking it if needed: the
    torchair of an exact torch_npu ``version``, or (None) of the line's newest release."""
    root = cache_root()
    key = cache_key() if version is None else f"torchair-{version}"
    target = root / key
    marker = target / ".complete"
    if marker.exists():
        return target
    with _locked(root / f".{key}.lock"):
        if marker.exists():
            return target
        wheel = wheel_file(version)
        with tempfile.TemporaryDirectory(prefix="torch_npu-wheel-", dir=root) as tmp:
            staging = Path(tmp) / "unpacked"
            count = _unpack(wheel, staging)
            with warnings.catch_warnings():  # torchair's sources have invalid escape sequences
                warnings.simplefilter("ignore")
                compileall.compile_dir(str(staging), quiet=2)
            (staging / ".complete").write_text(f"{wheel.name}\n{count} files\n")
            if target.exists():
                shutil.rmtree(target)
            os.replace(staging, target)
    return target


def _declared_ops():
    """The torch_npu ops our eager kernels call and the GE ops our converters build, as the fused
    ops declare them (:data:`npu_fusion.lowering.FUSED_OPS`)."""
    from npu_fusion.lowering import FUSED_OPS

    return tuple(op.npu.op for op in FUSED_OPS), tuple(op.ge.op for op in FUSED_OPS)


TORCH_NPU_OPS, GE_OPS = _declared_ops()
_GENERATED_GE_OPS = WHEEL_PREFIX + "_ge_concrete_graph/auto_generated_ge_raw_ops.py"
_TORCHAIR_CONVERTERS = WHEEL_PREFIX + "_ge_concrete_graph/ge_converter/custom/{op}.py"
#: an eager kernel's refusal of an argument's value, compiled into torch_npu's library
#: ("The rotary_mode of npu_rotary_mul_backward should be half or interleave, but got").
_EAGER_VALUE_MESSAGE = re.compile(rb"The (\w+) of (\w+) should be ([ -~]*?), but got")


def _schemas_in(text: str, pattern: str) -> dict:
    """``{op: schema}`` for each of :data:`TORCH_NPU_OPS` whose schema ``pattern`` finds in ``text``."""
    found = {}
    for op in TORCH_NPU_OPS:
        match = re.search(pattern.format(op=re.escape(op)), text)
        if match:
            found[op] = match.group(1)
    return found


def _generated_ir_docs(text: str) -> dict:
    """``{GE op: its REG_OP text}`` from the docstrings of torchair's generated builders."""
    docs = {}
    for op in GE_OPS:
        match = re.search(r'\ndef %s\([\s\S]*?"""(REG_OP\(%s\)[\s\S]*?)"""' % (op, op), text)
        if match:
            docs[op] = match.group(1).replace("\\n", "")
    return docs


def _read_contract_sources(wheel: Path) -> dict:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        yaml_schemas, yaml_path = {}, None
        for name in sorted(n for n in names if n.startswith("torch_npu/") and n.endswith(".yaml")):
            found = _schemas_in(archive.read(name).decode(errors="replace"), r"\bfunc: ({op}\(.*\) -> .*)")
            if found and not yaml_schemas:
                yaml_schemas, yaml_path = found, name
        library = archive.read("torch_npu/lib/libtorch_npu.so")
        registered = _schemas_in(library.decode("latin-1"), r"\x00({op}\([ -~]*\) -> [ -~]*)\x00")
        values = {}
        for keyword, op, words in _EAGER_VALUE_MESSAGE.findall(library):
            if op.decode() in TORCH_NPU_OPS:
                values.setdefault(op.decode(), {})[keyword.decode()] = words.decode()
        generated = archive.read(_GENERATED_GE_OPS).decode()
        converters = {op: archive.read(_TORCHAIR_CONVERTERS.format(op=op)).decode()
                      for op in TORCH_NPU_OPS if _TORCHAIR_CONVERTERS.format(op=op) in names}
    return {
        "ops": sorted(TORCH_NPU_OPS + GE_OPS),
        "wheel": wheel.name,
        "yaml_path": yaml_path,
        "yaml_schemas": yaml_schemas,
        "registered_schemas": registered,
        "eager_values": values,
        "eager_rotary_modes": values.get("npu_rotary_mul_backward", {}).get("rotary_mode"),
        "ge_ir": _generated_ir_docs(generated),
        "torchair_value_maps": {op: re.findall(r'"([a-z-]+)": (\d)', text) for op, text in converters.items()},
        "torchair_rotary_modes": re.findall(r'"([a-z-]+)": (\d)', converters.get("npu_rotary_mul_backward", "")),
    }


def contract_sources(version: Optional[str] = None) -> dict:
    """What torch_npu ``version``'s wheel says about the ops npu-fusion uses (cached as JSON):

    * ``yaml_schemas`` / ``registered_schemas``: ``{op: schema}`` from the codegen yaml
      (``yaml_path``) and as compiled into ``libtorch_npu.so`` (what the dispatcher registers);
    * ``eager_values``: ``{op: {argument: values}}``, what an eager kernel accepts where its own
      error message words it (``"half or interleave"``); ``eager_rotary_modes``: that of
      ``npu_rotary_mul_backward``'s ``rotary_mode``;
    * ``ge_ir``: ``{GE op: REG_OP text}`` from torchair's generated builders' docstrings;
    * ``torchair_value_maps``: ``{op: [(value, GE mode)]}`` torchair's own converter of each op
      maps (``torchair_rotary_modes``: ``npu_rotary_mul_backward``'s).

    The cache is read again when the fused ops name other ops than it holds.
    """
    key = cache_key() if version is None else f"torch_npu-{version}"
    cached = cache_root() / f"{key}-op-contracts.json"
    if cached.exists():
        sources = json.loads(cached.read_text())
        if sources.get("ops") == sorted(TORCH_NPU_OPS + GE_OPS):
            return sources
    sources = _read_contract_sources(wheel_file(version))
    cached.write_text(json.dumps(sources, indent=1))
    return sources


class _CannStubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``torchair.core._torchair`` and its siblings from :mod:`cann_stub`."""

    def __init__(self, package: str = "torchair"):
        self.names = {f"{package}.{rel}": names for rel, names in cann_stub.MODULES.items()}

    def find_spec(self, fullname, path=None, target=None):
        if fullname in self.names:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return cann_stub.make_module(spec.name, self.names[spec.name])

    def exec_module(self, module):
        pass


def _import_package(name: str, directory: Path):
    """Import the package ``directory/name`` as the top-level package ``name`` (its own absolute
    imports of ``name.x`` then resolve through its ``__path__``), without ``directory`` on sys.path."""
    package = directory / name
    spec = importlib.util.spec_from_file_location(name, package / "__init__.py",
                                                  submodule_search_locations=[str(package)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        for loaded in [n for n in sys.modules if n == name or n.startswith(name + ".")]:
            del sys.modules[loaded]
        raise
    return module


_TORCHAIR = None


def load_torchair():
    """Import torchair from the unpacked wheel with CANN stubbed (once per process)."""
    global _TORCHAIR
    if _TORCHAIR is not None:
        return _TORCHAIR
    existing = sys.modules.get("torchair")
    if existing is not None and getattr(existing, "__file__", None):
        raise TorchairUnavailable(f"a torchair is already imported from {existing.__file__}", offline=False)
    if existing is not None:
        # A namespace package: with tests/ on sys.path (pytest's rootdir
        # insertion), the directory tests/torchair looks like one.
        for name in [n for n in sys.modules if n == "torchair" or n.startswith("torchair.")]:
            del sys.modules[name]
    if importlib.util.find_spec("google.protobuf") is None:
        raise TorchairUnavailable("torchair needs the 'protobuf' package; install the test extras", offline=False)
    sources = ensure_torchair_sources()
    if not any(isinstance(f, _CannStubFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _CannStubFinder())
    # torchair installs SIGINT/SIGTERM handlers that finalize GE and re-raise;
    # keep the test runner's own.
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with warnings.catch_warnings():  # its sources' invalid escapes, torch.jit deprecations
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.simplefilter("ignore", SyntaxWarning)
            torchair = _import_package("torchair", sources)
    finally:
        for sig, handler in handlers.items():
            if handler is not None:
                signal.signal(sig, handler)
    if not str(getattr(torchair, "__file__", "")).startswith(str(sources)):
        raise TorchairUnavailable(f"imported torchair from {torchair.__file__}, not {sources}", offline=False)
    _TORCHAIR = torchair
    return torchair
