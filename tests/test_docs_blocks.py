"""Every code block of README.md and docs/*.md runs, so the documentation cannot drift.

Each fenced ``python`` block, and each shell block that runs ``torchrun``, ``python -m metamat``
or a script of ``examples/`` / ``bench/``, says how it runs in an HTML comment right before it
(invisible on GitHub)::

    <!-- test: run -->                      python: one process; bash: ``bash -e``
    <!-- test: run world=2 -->              python under ``torchrun --nproc_per_node 2`` (gloo, CPU)
    <!-- test: run world=2 id=quickstart -->  other blocks may build on its files:
    <!-- test: run uses=quickstart -->      runs in the folder where ``quickstart`` ran
    <!-- test: run requires=transformers -->  skipped when a package is missing
    <!-- test: skip reason="needs a GPU" -->  compiled (python) or parsed (``bash -n``) only

Blocks run in a temporary folder with ``examples/``, ``bench/`` and ``scripts/`` linked in, this
interpreter as ``python`` / ``python3``, ``torchrun`` as ``python -m torch.distributed.run
--standalone`` and the repository on ``PYTHONPATH``. A block passes when it exits 0.
"""
from __future__ import annotations

import dataclasses
import glob
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
SHELL = {"bash", "sh", "shell", "console"}
COMMANDS = re.compile(r"\btorchrun\b|\bpython3? -m metamat\b|\bpython3? (examples|bench)/")
MARKER = re.compile(r"^\s*<!--\s*test:\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^(\s*)(```+)\s*([\w+-]*)(.*)$")


@dataclasses.dataclass
class Block:
    doc: str
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    marker: Optional[str]  # the text after "test:", None when there is none
    mode: str = ""  # run | skip
    world: int = 1
    id: Optional[str] = None
    uses: Optional[str] = None
    requires: List[str] = dataclasses.field(default_factory=list)
    reason: str = ""
    timeout: int = 300

    @property
    def name(self) -> str:
        return f"{self.doc}:{self.line}" + (f"[{self.id}]" if self.id else "")

    @property
    def needs_marker(self) -> bool:
        return self.lang == "python" or (self.lang in SHELL and bool(COMMANDS.search(self.code)))


def _parse_marker(b: Block) -> None:
    words = shlex.split(b.marker or "")
    if not words or words[0] not in ("run", "skip"):
        raise ValueError(f"{b.name}: the marker must start with 'run' or 'skip': {b.marker!r}")
    b.mode = words[0]
    for w in words[1:]:
        k, _, v = w.partition("=")
        if k == "world":
            b.world = int(v)
        elif k == "id":
            b.id = v
        elif k == "uses":
            b.uses = v
        elif k == "requires":
            b.requires = v.split(",")
        elif k == "reason":
            b.reason = v
        elif k == "timeout":
            b.timeout = int(v)
        else:
            raise ValueError(f"{b.name}: unknown marker field {k!r}")
    if b.mode == "skip" and not b.reason:
        raise ValueError(f"{b.name}: a skipped block says why (reason=...)")
    if b.world > 1 and b.lang != "python":
        raise ValueError(f"{b.name}: world= is for python blocks (shell blocks call torchrun)")


def blocks_of(doc: str) -> List[Block]:
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        lines = f.read().split("\n")
    out: List[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, ticks, lang = m.group(1), m.group(2), m.group(3).lower()
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(ticks):
            j += 1
        code = "\n".join(ln[len(indent):] if ln.startswith(indent) else ln for ln in lines[i + 1:j])
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        mk = MARKER.match(lines[k]) if k >= 0 else None
        b = Block(doc, i + 1, lang, code + "\n", mk.group(1) if mk else None)
        if b.marker is not None:
            _parse_marker(b)
        out.append(b)
        i = j + 1
    return out


ALL = [b for d in DOCS for b in blocks_of(d)]
TESTED = [b for b in ALL if b.marker is not None]
BY_ID: Dict[str, Block] = {b.id: b for b in TESTED if b.id}
_RAN: Dict[str, str] = {}  # block id -> the folder it ran in (blocks with uses= run there too)


def _tools(d: str) -> str:
    bin_dir = os.path.join(d, ".bin")
    os.makedirs(bin_dir, exist_ok=True)
    for name, body in (("python", f'exec "{sys.executable}" "$@"'),
                       ("python3", f'exec "{sys.executable}" "$@"'),
                       ("torchrun", f'exec "{sys.executable}" -m torch.distributed.run --standalone "$@"')):
        p = os.path.join(bin_dir, name)
        with open(p, "w") as f:
            f.write("#!/bin/sh\n" + body + "\n")
        os.chmod(p, 0o755)
    for sub in ("examples", "bench", "scripts"):
        link = os.path.join(d, sub)
        if not os.path.exists(link):
            os.symlink(os.path.join(ROOT, sub), link)
    return bin_dir


def _execute(b: Block, d: str) -> None:
    env = dict(os.environ)
    env["PATH"] = _tools(d) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    if b.lang == "python":
        script = os.path.join(d, f"_block_{os.path.basename(b.doc).split('.')[0]}_{b.line}.py")
        with open(script, "w") as f:
            f.write(b.code)
        cmd = [sys.executable, script] if b.world == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc_per_node", str(b.world), script]
    else:
        cmd = ["bash", "-euo", "pipefail", "-c", b.code]
    r = subprocess.run(cmd, cwd=d, env=env, capture_output=True, text=True, timeout=b.timeout)
    if r.returncode != 0:
        pytest.fail(f"{b.name} exited {r.returncode}\n--- block ---\n{b.code}\n--- output (end) ---\n"
                    f"{(r.stdout + r.stderr)[-6000:]}", pytrace=False)


def _folder_for(b: Block, base: str) -> str:
    if b.uses is None:
        return tempfile.mkdtemp(prefix=f"block{b.line}_", dir=base)
    if b.uses not in _RAN:
        producer = BY_ID.get(b.uses)
        assert producer is not None, f"{b.name}: uses={b.uses}, but no block has id={b.uses}"
        _run_block(producer, base)
    return _RAN[b.uses]


def _run_block(b: Block, base: str) -> None:
    for mod in b.requires:
        if importlib.util.find_spec(mod) is None:
            pytest.skip(f"{b.name}: needs {mod}")
    d = _folder_for(b, base)
    _execute(b, d)
    if b.id:
        _RAN[b.id] = d


@pytest.fixture(scope="session")
def blocks_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("doc_blocks"))


def _param(b: Block):
    marks = [pytest.mark.multiprocess] if b.world > 1 else []
    return pytest.param(b, id=b.name, marks=marks)


@pytest.mark.parametrize("block", [_param(b) for b in TESTED])
def test_block(block: Block, blocks_dir):
    if block.mode == "skip":
        if block.lang == "python":
            compile(block.code, block.name, "exec")
        else:
            r = subprocess.run(["bash", "-n", "-c", block.code], capture_output=True, text=True)
            assert r.returncode == 0, r.stderr
        pytest.skip(f"compiled only: {block.reason}")
    _run_block(block, blocks_dir)


def test_every_runnable_block_says_how_it_runs():
    missing = [b.name for b in ALL if b.needs_marker and b.marker is None]
    assert not missing, ("blocks without a '<!-- test: ... -->' marker before them: "
                         + ", ".join(missing))
    assert len(BY_ID) == len([b for b in TESTED if b.id]), "two blocks share an id"


def test_relative_links_resolve():
    link = re.compile(r"\]\(([^)#\s]+)(#[^)]*)?\)")
    broken = []
    for doc in DOCS:
        with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
            text = f.read()
        for target, _ in link.findall(text):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not os.path.exists(os.path.join(ROOT, os.path.dirname(doc), target)):
                broken.append(f"{doc}: {target}")
    assert not broken, broken


def test_version_agrees_with_changelog_and_pyproject():
    import metamat

    with open(os.path.join(ROOT, "CHANGELOG.md"), encoding="utf-8") as f:
        versions = re.findall(r"^## (\d+\.\d+\.\d+)", f.read(), re.M)
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        project = re.search(r'^version = "([^"]+)"', f.read(), re.M).group(1)
    assert versions and versions[0] == metamat.__version__ == project, (versions[:1], metamat.__version__, project)


def test_documented_api_has_docstrings():
    """Every public name of the API reference (docs/api) has a docstring, its public methods
    too, and a function with parameters says what they are (Google style: ``Args:``)."""
    import inspect

    import metamat
    import metamat.checkpoint as ck
    import metamat.emulation as em
    import metamat.report as rp

    objs = {f"metamat.{n}": getattr(metamat, n) for n in metamat.__all__}
    objs.update({f"metamat.checkpoint.{n}": getattr(ck, n) for n in ck.__all__})
    objs.update({f"metamat.emulation.{n}": getattr(em, n) for n in em.__all__})
    objs.update({"metamat.report.RankSummary": rp.RankSummary,
                 "metamat.report.JobSummary": rp.JobSummary})
    bad = []
    for name, o in objs.items():
        own = o.__dict__.get("__doc__") if isinstance(o, type) else getattr(o, "__doc__", None)
        if not own:
            bad.append(f"{name}: no docstring")
            continue
        if inspect.isfunction(o) and [p for p in inspect.signature(o).parameters] and "Args:" not in own:
            bad.append(f"{name}: no Args section")
        if isinstance(o, type) and not issubclass(o, BaseException):
            for m, v in vars(o).items():
                f = v.fget if isinstance(v, property) else getattr(v, "__func__", v)
                if not m.startswith("_") and inspect.isfunction(f) and not f.__doc__:
                    bad.append(f"{name}.{m}: no docstring")
    assert not bad, bad
