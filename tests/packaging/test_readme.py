"""The README and the pages it links (docs/, benchmarks/README.md): their examples run as written
(on the CPU, through the reference backend), the facts they quote from the code are the code's,
the install commands are the ones CI runs, their links resolve, and the raw benchmark files they
describe are there."""

import re
import tarfile
from pathlib import Path

import pytest

from support import REPO as ROOT

README = ROOT / "README.md"
DOCS = ROOT / "docs"
BENCHMARKS = ROOT / "benchmarks"
PAGES = [README, *sorted(DOCS.glob("*.md")), BENCHMARKS / "README.md"]


def _python_block(page: Path, section: str) -> str:
    """The first ```python block after the heading ``section`` of ``page``."""
    text = page.read_text().split(f"\n{section}\n", 1)[1]
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


def _run(page: Path, code: str) -> dict:
    namespace: dict = {}
    exec(compile(code, str(page), "exec"), namespace)
    return namespace


def test_usage_example_runs():
    """The first page's short example: a causal forward and backward, then one decoding step."""
    ns = _run(README, _python_block(README, "## Usage"))
    q, out = ns["q"], ns["out"]
    assert q.grad is not None and q.grad.shape == q.shape and q.grad.isfinite().all()
    assert out.shape == (2, 1, 16, 64) and not out.isnan().any()
    # the decode step appended its key at each sequence's cache_seqlens row, and nowhere else
    k_cache, step_k = ns["k_cache"], ns["step_k"]
    assert (k_cache[0, 17] == step_k[0, 0]).all() and (k_cache[1, 400] == step_k[1, 0]).all()
    assert k_cache[0, 18].abs().sum() == 0 and k_cache[1, 16].abs().sum() == 0
    assert k_cache.abs().sum(dim=(2, 3)).count_nonzero() == 2


def test_the_api_example_runs():
    """docs/compatibility.md's tour of the API (every function, varlen, decoding with rotary)."""
    page = DOCS / "compatibility.md"
    namespace = _run(page, _python_block(page, "## The API by example"))
    out = namespace["out"]
    assert out.shape == (2, 1, 16, 64) and not out.isnan().any()
    # the decode step appended its key at each sequence's cache_seqlens row
    k_cache, step_k = namespace["k_cache"], namespace["step_k"]
    assert k_cache[0, 17].abs().sum() > 0 and k_cache[0, 18].abs().sum() == 0
    assert k_cache[1, 400].abs().sum() > 0 and k_cache[1, 16].abs().sum() == 0
    assert namespace["q_rot"].shape == namespace["q"].shape


def test_the_beyond_fa2_example_runs():
    """docs/compatibility.md's example of v's own head dim, attention sinks and MLA decoding."""
    page = DOCS / "compatibility.md"
    namespace = _run(page, _python_block(page, "## Beyond flash-attn 2.8: head dims, attention sinks, MLA"))
    sinks, out = namespace["sinks"], namespace["out"]
    assert sinks.grad is not None and sinks.grad.shape == (8,) and sinks.grad.isfinite().all()
    assert out.shape == (1, 1, 128, 512) and not out.isnan().any()


def _default_arch_lists(page: Path) -> list[str]:
    arch_list = re.compile(r"`(\d{2,3}[a-z]?(?:\+PTX)?(?:;\d{2,3}[a-z]?(?:\+PTX)?)+)`")
    return [m.group(1) for line in page.read_text().splitlines() if "default" in line
            for m in arch_list.finditer(line)]


def test_the_default_architectures_are_the_code_s():
    """Every architecture list a page calls the default is ``archs.DEFAULT_CUDA_ARCHS``; the
    configuration table and the variant matrix each quote it."""
    from flash_attn.aot import archs

    quoted = {page.relative_to(ROOT).as_posix(): _default_arch_lists(page) for page in PAGES}
    assert quoted["docs/configuration.md"], quoted  # the configuration table
    assert quoted["docs/install-and-build.md"], quoted  # the variant matrix
    assert quoted["README.md"], quoted  # the first page's short configuration table
    assert {arch for lists in quoted.values() for arch in lists} == {archs.DEFAULT_CUDA_ARCHS}, quoted


def _commands(text: str) -> list[str]:
    """Shell lines without comments, `python -m` and pip's `--quiet`, whitespace collapsed."""
    lines = (line.split("#", 1)[0] for line in text.splitlines())
    lines = (line.replace("python -m ", "").replace("--quiet ", "") for line in lines)
    return [" ".join(line.split()) for line in lines if line.strip()]


def test_the_offline_pip_path_is_what_ci_runs():
    """The README's pip path, after making its virtual environment, is `.ci/run`'s, ending in the
    test command `pytest -q`."""
    install = README.read_text().split("The offline pip path", 1)[1]
    block = re.search(r"```bash\n(.*?)```", install, re.S).group(1)
    readme_steps = [c for c in _commands(block) if "venv" not in c]
    ci_steps = [c for c in _commands((ROOT / ".ci" / "run").read_text())
                if c.startswith(("pip install", "FLASH_ATTN", "pytest"))]
    assert readme_steps[-1] == "pytest -q"
    ci_steps = [c for c in ci_steps if "--upgrade pip" not in c]
    assert ci_steps == readme_steps, (ci_steps, readme_steps)


def test_the_virtual_environments_ci_and_the_readme_make_are_ignored():
    """The venvs `.ci/run` and the README's pip path make inside the checkout are git-ignored: a
    copy of the checkout's files (rattler-build's `source: path`, the tests' copy_source) takes
    every file git does not ignore, and a copied venv is GBs (a CI run once ran out of disk so)."""
    import subprocess

    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    install = README.read_text().split("The offline pip path", 1)[1]
    texts = [(ROOT / ".ci" / "run").read_text(), re.search(r"```bash\n(.*?)```", install, re.S).group(1)]
    venvs = {name for text in texts for name in re.findall(r"-m venv (\S+)", text)}
    assert len(venvs) >= 2, venvs
    for venv in venvs:
        ignored = subprocess.run(["git", "check-ignore", "-q", f"{venv}/pyvenv.cfg"], cwd=ROOT)
        assert ignored.returncode == 0, f"{venv}/ is not in .gitignore"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    seen: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        slug = _slug(heading)
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_links_between_pages_resolve():
    """Every relative Markdown link of the README, docs/ and benchmarks/README.md names a file that
    exists and, after `#`, a heading of that file."""
    broken = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, broken


def test_the_raw_benchmark_files_are_where_the_page_says():
    """benchmarks/README.md describes every archive in benchmarks/raw/ and names only files that
    exist; each archive holds one run's folder, named as the archive is."""
    page = (BENCHMARKS / "README.md").read_text()
    named = set(re.findall(r"`((?:raw|plots)/[\w.-]+)`", page))
    assert named and not [path for path in named if not (BENCHMARKS / path).is_file()], named
    table = page.split("## Raw files", 1)[1].split("\n#", 1)[0]
    archives = sorted((BENCHMARKS / "raw").glob("*.tar.xz"))
    assert archives and [a.name for a in archives if f"`raw/{a.name}`" not in table] == []
    for archive in archives:
        run = archive.name.removesuffix(".tar.xz")
        with tarfile.open(archive) as tar:
            members = tar.getnames()
        assert members and all(m == run or m.startswith(f"{run}/") for m in members), archive.name
        assert not any(m.endswith(".png") for m in members), archive.name  # plots live in plots/
    assert not [p for p in BENCHMARKS.iterdir() if p.name not in {"README.md", "raw", "plots"}]
