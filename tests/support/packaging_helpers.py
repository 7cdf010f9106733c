"""Helpers of the packaging tests (tests/packaging/): render the recipe, run its build script, assemble and open
a ``.conda`` file. Nothing here needs a conda channel or the network."""

from __future__ import annotations

import importlib.metadata
import io
import json
import os
import shutil
import site
import subprocess
import sys
import tarfile
import time
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement

from support import REPO

RECIPE = REPO / "recipe" / "recipe.yaml"
# The recipe's outputs: flash-attn itself, and FlashAttention-3's interface on it (fa3_interface/).
MAIN_OUTPUT, FA3_OUTPUT = "flash-attn", "flash-attn-fa3"
BUILD_SCRIPT = REPO / "recipe" / "build.sh"
BUILD_BAT = REPO / "recipe" / "build.bat"
VARIANTS = REPO / "conda_build_config.yaml"
PIXI = REPO / "pixi.toml"
# In this workplace and in CI, shared/ lies beside the clone.
SCHEMAS = REPO.parent / "shared" / "schemas"


@dataclass
class Rendered:
    variant: dict
    recipe: dict  # the stage-1 recipe: every Jinja expression and `if:` evaluated

    @property
    def cuda(self) -> str:
        return str(self.variant.get("cuda_compiler_version", "None"))


def render(platform: str, variants=None, build_platform: str | None = None, recipe_path: Path = RECIPE,
           output: str | None = None) -> list[Rendered]:
    """The recipe's output ``output`` (unless named, the package of the context's ``name``:
    flash-attn itself, whatever the recipe calls it) rendered for ``platform`` (no
    solving): with conda_build_config.yaml, or the given ``VariantConfig``; built on ``platform``
    itself unless ``build_platform`` names another (cross-compiling). Skipped variants are left
    out, as rattler-build leaves them out."""
    from rattler_build import JinjaConfig, PlatformConfig, RenderConfig, Stage0Recipe, VariantConfig

    build_platform = build_platform or platform
    platform_config = PlatformConfig(target_platform=platform, build_platform=build_platform, host_platform=platform)
    if variants is None:
        variants = VariantConfig.from_conda_build_config(VARIANTS, JinjaConfig(platform_config))
    recipe = Stage0Recipe.from_file(recipe_path)
    rendered = [Rendered(dict(v.variant), v.recipe.to_dict())
                for v in recipe.render(variants, RenderConfig(platform=platform_config))]
    return [r for r in rendered if r.recipe["package"]["name"] == (output or _name(r))
            and not _skipped(r, platform, build_platform, recipe_path)]


def _name(rendered: Rendered) -> str:
    """The context's ``name``: the conda package of flash-attn itself (docs/conda-forge.md)."""
    return rendered.recipe.get("context", {}).get("name", MAIN_OUTPUT)


def _skipped(rendered: Rendered, platform: str, build_platform: str, recipe_path: Path = RECIPE) -> bool:
    """The recipe's ``build.skip`` conditions for this variant. py-rattler-build evaluates them but
    does not report the result, so they are evaluated here, with jinja2, over the same names:
    the rendered context, the variant and the platform selectors."""
    import jinja2
    import yaml

    conditions = yaml.safe_load(recipe_path.read_text())["build"].get("skip", [])
    os_name, _, arch = platform.partition("-")
    names = {"linux": os_name == "linux", "osx": os_name == "osx", "win": os_name == "win",
             "unix": os_name in ("linux", "osx"), "x86_64": arch == "64", "aarch64": arch == "aarch64",
             "arm64": arch == "arm64", "target_platform": platform, "build_platform": build_platform,
             "host_platform": platform, **rendered.variant, **rendered.recipe.get("context", {})}
    environment = jinja2.Environment(undefined=jinja2.StrictUndefined)
    return any(environment.compile_expression(str(c))(**names) for c in conditions)


def triton_requirement() -> str:
    """The Triton range the package allows (pyproject.toml's `triton` extra; the recipe and the
    build requirement say the same, tests/aot/test_triton_bounds.py)."""
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["triton"]
    return next(r for r in extra if r.startswith("triton"))


def cuda_toolkit() -> Path | None:
    """The CUDA toolkit to link the op library's static runtime from: CUDA_HOME, else /usr/local/cuda."""
    home = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
    return home if (home / "include" / "cuda_runtime.h").is_file() else None


def pip_torch_dir() -> Path:
    """The ``torch`` package of this interpreter (pip's wheel), found without importing it."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    assert spec is not None and spec.submodule_search_locations, "torch is not installed"
    return Path(list(spec.submodule_search_locations)[0])


# The oldest PyTorch the recipe builds against (recipe.yaml's torch_min: `libtorch 2.10.* cpu_*` in host).
TORCH_FLOOR = "2.10"
TORCH_FLOOR_CACHE = Path(os.environ.get("FLASH_ATTN_TORCH_FLOOR_CACHE", Path.home() / ".cache" / "flash-attn-tests"))


def torch_floor_dir() -> Path:
    """A ``torch`` folder of PyTorch 2.10 (the recipe's floor) holding what a build against it
    reads: ``include/``, ``version.py`` and the libraries the op library links (``lib/libtorch_cpu.so``,
    ``lib/libc10.so`` and what they need from torch/lib). From PyPI's wheel: ``pip download
    torch==2.10.* --no-deps`` into ``TORCH_FLOOR_CACHE`` (``$FLASH_ATTN_TORCH_FLOOR_CACHE``, default
    ``~/.cache/flash-attn-tests``), once: ~0.9 GB downloaded, ~0.6 GB extracted; the wheel is
    deleted after extraction. Raises RuntimeError when pip cannot get it (offline)."""
    target = TORCH_FLOOR_CACHE / f"torch-{TORCH_FLOOR}"
    done = target / ".complete"
    if done.is_file():
        return target / "torch"
    download = TORCH_FLOOR_CACHE / "download"
    download.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                           "-d", str(download), f"torch=={TORCH_FLOOR}.*"], capture_output=True, text=True)
    wheels = sorted(download.glob(f"torch-{TORCH_FLOOR}.*.whl"))
    if proc.returncode != 0 or not wheels:
        raise RuntimeError(f"pip download torch=={TORCH_FLOOR}.* failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    with zipfile.ZipFile(wheels[-1]) as wheel:
        wanted = [n for n in wheel.namelist()
                  if n.startswith("torch/include/") or n == "torch/version.py"
                  or (n.startswith("torch/lib/") and not n.startswith(("torch/lib/libtorch_cuda", "torch/lib/libc10_cuda",
                                                                       "torch/lib/libcaffe2_nvrtc", "torch/lib/libtorch_python")))]
        wheel.extractall(target, wanted)
    for library in (target / "torch" / "lib").glob("*.so*"):
        library.chmod(0o755)
    for wheel_file in wheels:
        wheel_file.unlink()
    done.write_text(wheels[-1].name)
    return target / "torch"


def lay_out_conda_forge_libtorch(prefix: Path, torch_dir: Path | None = None) -> Path:
    """A conda prefix shaped like one holding conda-forge's ``libtorch``: the C++ headers in
    ``include/`` (``include/torch/csrc/stable/...``, ``include/c10``, ...) and the libraries in
    ``lib/`` (``lib/libtorch_cpu.so``), nothing under ``site-packages/torch``.

    Stand-in: conda-forge is unreachable here, so the files are pip's torch wheel's, linked (not
    copied: 0.5 GB) to where libtorch's build script moves them (pytorch-cpu-feedstock
    recipe/build.sh: torch/include/* to $PREFIX/include, torch/lib/* to $PREFIX/lib). It has the
    layout, not conda-forge's own build of the library (its options, its dependencies' names)."""
    torch_dir = torch_dir or pip_torch_dir()
    for folder in ("include", "lib"):
        (prefix / folder).mkdir(parents=True, exist_ok=True)
        for entry in (torch_dir / folder).iterdir():
            target = prefix / folder / entry.name
            if not target.exists():
                target.symlink_to(entry)
    return prefix


def copy_source(dest: Path) -> Path:
    """The files rattler-build's ``source: path: ..`` takes: tracked and untracked, not ignored."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO,
                            check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


def copy_recipe_sources(rendered: Rendered, dest: Path) -> Path:
    """The work directory rattler-build makes from a rendered recipe's ``path`` sources: each path
    (relative to recipe/) copied to its ``target_directory`` (a folder) or by its name (a file),
    with .gitignore applied (rattler-build's default ``use_gitignore``). Only path sources."""
    dest.mkdir(parents=True, exist_ok=True)
    for source in rendered.recipe.get("source", []):
        assert "path" in source, f"not a path source: {source}"
        path = (RECIPE.parent / source["path"]).resolve()
        relative = path.relative_to(REPO)
        listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z", "--", str(relative)], cwd=REPO,
                                check=True, capture_output=True).stdout.decode().split("\0")
        for name in filter(None, listed):
            file = REPO / name
            if not file.is_file():
                continue
            if path.is_dir():
                target = dest / source.get("target_directory", ".") / Path(name).relative_to(relative)
            else:
                target = dest / source.get("target_directory", ".") / source.get("file_name", path.name)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(file, target)
    return dest


@dataclass
class BuildRun:
    seconds: float
    peak_rss_mib: float  # of the largest single process of the build (ru_maxrss of the children)
    log: str


def run_build_script(src: Path, prefix: Path, python: Path, env: dict) -> BuildRun:
    """recipe/build.sh, as rattler-build runs it, with this machine's toolchain in place of the
    conda build environment: ``PREFIX`` is a staging folder, ``PYTHON`` the given interpreter."""
    import resource

    full_env = {**os.environ, "PREFIX": str(prefix), "PYTHON": str(python), "SP_DIR": str(site_packages(python)),
                "SRC_DIR": str(src), "PIP_NO_INDEX": "1", **env}
    start = time.monotonic()
    proc = subprocess.run(["bash", str(BUILD_SCRIPT)], cwd=src, env=full_env, capture_output=True, text=True)
    seconds = time.monotonic() - start
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise AssertionError(f"recipe/build.sh failed ({proc.returncode}):\n{log[-6000:]}")
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return BuildRun(seconds, peak, log)


def run_test_built_packages(work: Path, packages: dict[str, list[str]], driver_cuda: str | None, task_env: dict,
                            failing: str = "") -> tuple[subprocess.CompletedProcess, dict[str, str]]:
    """recipe/test_built_packages.sh on empty stand-ins of ``packages`` ({subdir: [file names]}) in
    ``work``/output, with the variables ``task_env`` (what pixi's task exports) and stand-ins on PATH:
    `rattler-build` records each call with its CONDA_OVERRIDE_CUDA and fails for a package whose
    name contains ``failing``; `nvidia-smi` prints a driver header for CUDA ``driver_cuda`` (or is
    absent). Returns the script's result and {package file: CONDA_OVERRIDE_CUDA it was tested with}."""
    tools, log = work / "bin", work / "calls.log"
    tools.mkdir(parents=True)
    (work / "output").mkdir()
    for subdir, names in packages.items():
        (work / "output" / subdir).mkdir()
        for name in names:
            (work / "output" / subdir / name).write_bytes(b"")
    (tools / "rattler-build").write_text(
        "#!/usr/bin/env bash\n"
        f'echo "$* CONDA_OVERRIDE_CUDA=${{CONDA_OVERRIDE_CUDA:-}}" >> "{log}"\n'
        f'case "$*" in *{failing or "no-such-package"}*) exit 1 ;; esac\n')
    if driver_cuda:
        (tools / "nvidia-smi").write_text(
            "#!/usr/bin/env bash\n"
            f'echo "| NVIDIA-SMI 570.00   Driver Version: 570.00   CUDA Version: {driver_cuda}     |"\n')
    for tool in tools.iterdir():
        tool.chmod(0o755)
    system = ":".join(p for p in os.environ["PATH"].split(":") if not (Path(p) / "nvidia-smi").exists())
    env = {**{k: v for k, v in os.environ.items() if k != "CONDA_OVERRIDE_CUDA"}, **task_env, "PATH": f"{tools}:{system}"}
    result = subprocess.run(["bash", str(RECIPE.parent / "test_built_packages.sh"), "output"], cwd=work, env=env,
                            capture_output=True, text=True)
    calls = {}
    for line in (log.read_text().splitlines() if log.exists() else []):
        command, _, override = line.rpartition(" CONDA_OVERRIDE_CUDA=")
        assert command.startswith("test --package-file output/"), command
        calls[Path(command.split()[-1]).name] = override
    return result, calls


# Compiled code on Linux, macOS and Windows (shared libraries, Python extensions, objects).
COMPILED_SUFFIXES = {".so", ".dylib", ".dll", ".pyd", ".o", ".obj", ".a", ".lib"}


def compiled_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and (p.suffix in COMPILED_SUFFIXES or ".so." in p.name))


def run_from_site(site_dir: Path, *args: str, cwd: Path, extra_paths=(), env=None) -> subprocess.CompletedProcess:
    """``python -S *args`` with this interpreter, ``site_dir`` first on ``sys.path``, then
    ``extra_paths`` and this interpreter's own site-packages (for torch). ``-S`` skips the ``.pth``
    files, so an editable install of flash_attn (its import hook comes from a ``.pth`` file) cannot
    stand in for the copy under test; ``cwd`` must not be the source tree for the same reason."""
    paths = [str(site_dir), *map(str, extra_paths), *site.getsitepackages()]
    full_env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join(paths)}
    return subprocess.run([sys.executable, "-S", *args], cwd=cwd, env=full_env, capture_output=True, text=True)


def staged_site_packages(prefix: Path) -> Path:
    found = sorted(prefix.glob("lib/python3*/site-packages"))
    assert len(found) == 1, f"expected one site-packages under {prefix}: {found}"
    return found[0]


def assemble(rendered: Rendered, prefix: Path, output_dir: Path, platform: str, depends: list[str] | None = None) -> Path:
    """A ``.conda`` from the staged files and the rendered metadata. CEP-20 layout: a
    Python-version-independent package keeps its Python files in ``site-packages/`` (no
    ``lib/pythonX.Y``), like ``noarch: python``; the console script is the recipe's entry point,
    which the installer writes, so ``bin/`` from pip is not packaged. ``depends``: what rattler-build
    would write (``conda_channel.rattler_build_records``), by default the rendered run requirements."""
    from rattler_build import FileEntry, assemble_package

    site = staged_site_packages(prefix)
    files = [FileEntry.from_paths(path, Path("site-packages") / path.relative_to(site))
             for path in sorted(site.rglob("*")) if path.is_file() and "__pycache__" not in path.parts]
    recipe = rendered.recipe
    about = recipe.get("about", {})
    out = assemble_package(
        name=recipe["package"]["name"], version=str(recipe["package"]["version"]),
        target_platform=platform, build_string=recipe["build"]["string"], output_dir=output_dir,
        files=files, homepage=about.get("homepage"), license=about.get("license"),
        summary=about.get("summary"), description=about.get("description"),
        depends=depends if depends is not None else [str(d) for d in recipe["requirements"].get("run", [])],
        constrains=[str(d) for d in recipe["requirements"].get("run_constraints", [])],
        build_number=int(recipe["build"].get("number", 0)),
        noarch="python" if recipe["build"].get("python", {}).get("version_independent") else None,
        license_files=[REPO / name for name in _as_list(about.get("license_file"))],
        recipe_dir=RECIPE.parent, compression_level=19,
    )
    return Path(out.path)


def _as_list(value) -> list:
    if value is None:
        return []
    return value if isinstance(value, list) else [value]


@dataclass
class CondaArchive:
    index: dict
    files: dict  # path in the package -> bytes (payload and info/)


def open_conda(path: Path) -> CondaArchive:
    """Reads a ``.conda`` (a zip of two zstd-compressed tars) with the ``zstd`` tool."""
    files: dict[str, bytes] = {}
    with zipfile.ZipFile(path) as archive:
        for member in archive.namelist():
            if not member.endswith(".tar.zst"):
                continue
            raw = subprocess.run(["zstd", "-d", "-c", "-q"], input=archive.read(member),
                                 check=True, capture_output=True).stdout
            with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
                for info in tar.getmembers():
                    if info.isfile():
                        files[info.name] = tar.extractfile(info).read()
    return CondaArchive(json.loads(files["info/index.json"]), files)


def extract_into_venv(archive: CondaArchive, python: Path) -> Path:
    """Installs the package's ``site-packages/`` payload into a venv (what a conda installer does
    with a CEP-20 package) and returns that site-packages."""
    site = site_packages(python)
    for name, data in archive.files.items():
        if name.startswith("site-packages/"):
            target = site / name[len("site-packages/"):]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            if name.endswith(".so"):
                target.chmod(0o755)
    return site


# The suite's own distributions a test venv takes by hard link rather than a second copy (~0.8 GB
# and ~1 GB: the test venvs are the suite's biggest use of disk).
LINKED_DISTRIBUTIONS = ("torch", "triton")


def site_packages(python: Path) -> Path:
    """The site-packages folder of the Python ``python``."""
    return Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())


def make_venv(path: Path, *requirements: str) -> Path:
    """A fresh venv with ``requirements`` from the local wheel store (no index is contacted
    beyond what pip is configured with; torch 2.13.0 is on local disk). A requirement in
    ``LINKED_DISTRIBUTIONS`` that the suite's own environment meets is installed by hard-linking
    that environment's files (what uv does by default: the same files, installed from the same
    wheel, without a second copy on disk); pip then installs the rest, that distribution's own
    dependencies included."""
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    python = path / "bin" / "python"
    for requirement in requirements:
        _link_distribution(requirement, python)
    proc = subprocess.run([str(python), "-m", "pip", "install", "--quiet", *requirements],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise AssertionError(f"pip install {requirements} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return python


def _link_distribution(requirement: str, python: Path) -> None:
    """The suite's installed copy of ``requirement``'s distribution, linked into ``python``'s
    site-packages (copied where the two are on different file systems), if it is one of
    ``LINKED_DISTRIBUTIONS`` and its version meets the requirement; else nothing."""
    wanted = Requirement(requirement)
    if wanted.name not in LINKED_DISTRIBUTIONS:
        return
    try:
        installed = importlib.metadata.distribution(wanted.name)
    except importlib.metadata.PackageNotFoundError:
        return
    if not wanted.specifier.contains(installed.version, prereleases=True):
        return
    site = site_packages(python)
    for name in installed.files or ():
        if name.parts[0] == "..":
            continue  # console scripts: pip writes the venv's own
        source, target = Path(installed.locate_file(name)), site / name
        if not source.is_file():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(source, target)
        except OSError:
            shutil.copy2(source, target)
