"""The torch floor in requirements.txt is what lib and the chapters need.

Readers run the chapters on whatever torch their machine has (Colab's GPU runtime ships 2.11;
runtimes a notebook can pin go back to 2.6), while CI runs the locked 2.13. So:

- ``SINCE`` lists every torch API that lib or a chapter uses and that appeared after torch 2.0,
  with the release it appeared in (checked against torch's release notes and pull requests; the
  source of each is named beside it). Each must exist in the installed torch.
- ``GUARDED`` names those a chapter uses only behind a check with a clear message; the floor in
  requirements.txt must be at least the newest of the others, and at least what the installed
  ``transformers`` (which the chapters compare against) itself requires.
- The sources are scanned: every torch attribute chain (``torch.x.y``, through ``nn``/``F``/
  ``from torch... import``), every keyword passed to a torch callable and every ``Tensor``/
  ``Module``/``Optimizer`` method called (``x.m(...)``) must be in ``SINCE`` or in
  ``torch_api_baseline.txt`` (APIs of torch 2.0 or earlier). A new API fails here until
  someone looks up its version and files it. Tensor properties read without a call (``x.mT``,
  ``x.nbytes``), anywhere in a chain, count too, by name, like methods, and so does a keyword
  passed to a method (``m.load_state_dict(sd, assign=True)``) where the installed torch's method
  of that name takes it (by signature, ATen operator schema or docstring; the newest torch is
  installed, so a late keyword is seen, while matplotlib's ``scatter(color=)`` is not counted).
  Not seen: a method whose name built-in types share (``sort``, ``split``, ``add``, ``index``)
  called without a keyword that only torch's takes (``x.sort()`` is taken for a list's).
"""
from __future__ import annotations

import ast
import functools
import inspect
import json
import re
from importlib import metadata
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
BASELINE = Path(__file__).with_name("torch_api_baseline.txt")
COLAB_TORCH = Version("2.11.0")  # Colab's GPU runtime today (issue 28)

# API -> (the release it appeared in, where that is documented)
SINCE: dict[str, tuple[str, str]] = {
    "torch.compile": ("2.0", "PyTorch 2.0 release notes"),
    "torch.nn.functional.scaled_dot_product_attention": ("2.0", "PyTorch 2.0 release notes"),
    "torch.nn.functional.scaled_dot_product_attention(attn_mask=)": ("2.0", "as above"),
    "torch.nn.functional.scaled_dot_product_attention(dropout_p=)": ("2.0", "as above"),
    "torch.nn.functional.scaled_dot_product_attention(is_causal=)": ("2.0", "as above"),
    "Tensor.untyped_storage": ("2.0", "PyTorch 2.0: TypedStorage deprecated for it"),
    "Tensor.nbytes": ("2.1", "pytorch#98322, merged 2023-04-05, after 2.0.0"),
    "torch._dynamo.explain": ("2.1", "2.1 release notes: explain(fn)(*args), the form used"),
    "torch.utils.flop_counter.FlopCounterMode": ("2.1", "public torch.utils.flop_counter"),
    "torch.utils.flop_counter.FlopCounterMode(display=)": ("2.1", "as above"),
    "torch.nn.TransformerEncoderLayer(bias=)": ("2.1", "pytorch#101687, merged 2023-07"),
    # pytorch#114689 (Nov 2023): 2.2 or 2.3; the later is assumed
    "torch.nn.attention.SDPBackend.MATH": ("2.3", "pytorch#114689, torch.nn.attention"),
    "torch.nn.attention.sdpa_kernel": ("2.3", "pytorch#114689, replacing sdp_kernel"),
    "torch.nn.RMSNorm": ("2.4", "pytorch#121364 ('will be available in 2.4')"),
    "torch.nn.RMSNorm(eps=)": ("2.4", "as above"),
    "torch.nn.functional.rms_norm": ("2.4", "as above"),
    "torch.optim.AdamW(fused=)": ("2.4", "fused=True on a CPU (the CPU profile's): "
                                  "pytorch#123074 (Apr 2024); on CUDA since 2.0"),
    "torch.nn.functional.scaled_dot_product_attention(enable_gqa=)":
        ("2.5", "PyTorch 2.5 release (SDPA grouped-query attention)"),
    "torch.optim.Muon": ("2.9", "pytorch#160213 (Aug 2025), PyTorch 2.9"),
    "torch.optim.Muon(adjust_lr_fn=)": ("2.9", "as above"),
    "torch.optim.Muon(lr=)": ("2.9", "as above"),
    "torch.optim.Muon(weight_decay=)": ("2.9", "as above"),
}
# Used only behind a check that says what is missing: API -> (file, the check's text)
GUARDED: dict[str, tuple[str, str]] = {
    name: ("chapters/12a_architecture_training.ipynb", 'hasattr(torch.optim, "Muon")')
    for name in SINCE if name.startswith("torch.optim.Muon")
}


def _fused_adamw_on_cpu() -> bool:
    """Behaviour rather than a name: one fused AdamW step on a CPU parameter."""
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    torch.optim.AdamW([p], lr=0.1, fused=True).step()
    return bool((p < 1).all())


PROBES = {"torch.optim.AdamW(fused=)": _fused_adamw_on_cpu}


@functools.cache
def sources() -> dict[str, str]:
    """lib's modules and the chapters' code cells (shell and magic lines dropped)."""
    found = {str(p.relative_to(ROOT)): p.read_text() for p in sorted(ROOT.glob("lib/*.py"))}
    for path in sorted(ROOT.glob("chapters/*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        code = ("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        found[str(path.relative_to(ROOT))] = "\n".join(
            "\n".join(line for line in cell.splitlines()
                      if not line.lstrip().startswith(("%", "!")))
            for cell in code)
    return found


_BUILTIN_NAMES = set().union(*(dir(t) for t in (str, bytes, list, dict, set, tuple, int, float)))
_METHOD_OWNERS = {"Tensor": torch.Tensor, "Module": torch.nn.Module,
                  "Optimizer": torch.optim.Optimizer}
# Tensor attributes read without a call (x.mT, x.nbytes): properties, not methods
_TENSOR_PROPERTIES = {name for name in dir(torch.Tensor) if not name.startswith("_")
                      and not callable(getattr(torch.Tensor, name, None))} - _BUILTIN_NAMES


def torch_apis(source: str) -> set[str]:
    """The torch APIs one source uses: dotted chains, 'chain(kw=)' keywords, 'Tensor.m' methods."""
    tree = ast.parse(source)
    alias: dict[str, str] = {}
    others: set[str] = set()  # names of other modules (re.compile is no Module.compile)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    alias[a.asname or "torch"] = a.name if a.asname else "torch"
                else:
                    others.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            for a in node.names:
                alias[a.asname or a.name] = f"{node.module}.{a.name}"
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

    def chain(node: ast.AST) -> str | None:
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name) and node.id in alias:
            return ".".join([alias[node.id], *reversed(parts)])
        return None

    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and (name := chain(node.func)) is not None:
            used.update(f"{name}({k.arg}=)" for k in node.keywords if k.arg)
        if not isinstance(node, (ast.Attribute, ast.Name)):
            continue
        if (name := chain(node)) is not None:
            if not isinstance(parents.get(node), ast.Attribute):
                used.add(name)  # only the whole chain
            continue
        if (not isinstance(node, ast.Attribute) or node.attr.startswith("_")
                or isinstance(node.value, ast.Name) and node.value.id in others):
            continue
        call = parents.get(node)
        if isinstance(call, ast.Call) and call.func is node:
            used |= method_uses(node.attr, [k.arg for k in call.keywords if k.arg])
        elif node.attr in _TENSOR_PROPERTIES:  # read anywhere in a chain: x.mT.contiguous()
            used.add(f"Tensor.{node.attr}")
    return used


@functools.cache
def used_apis() -> dict[str, set[str]]:
    """API -> the files that use it, over lib and every chapter."""
    found: dict[str, set[str]] = {}
    for path, text in sources().items():
        for api in torch_apis(text):
            found.setdefault(api, set()).add(path)
    return found


def baseline() -> set[str]:
    lines = (line.split("#")[0].strip() for line in BASELINE.read_text().splitlines())
    return {line for line in lines if line}


def floor() -> Version:
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line and Requirement(line).name == "torch":
            spec = Requirement(line).specifier
            lows = [Version(s.version) for s in spec if s.operator in (">=", "==", "~=")]
            assert len(lows) == 1, f"requirements.txt: one lower bound for torch, got {spec}"
            assert COLAB_TORCH in spec, f"Colab's torch {COLAB_TORCH} must satisfy {spec}"
            return lows[0]
    raise AssertionError("requirements.txt names no torch requirement")


def resolve(api: str) -> object:
    """The object a dotted API names in the installed torch (AttributeError if missing)."""
    name = api.split("(")[0]
    if name.split(".")[0] in _METHOD_OWNERS:
        owner, attr = name.split(".", 1)
        return getattr(_METHOD_OWNERS[owner], attr)
    obj, parts = torch, name.split(".")[1:]
    for i, part in enumerate(parts):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            import importlib

            obj = importlib.import_module(".".join(["torch", *parts[:i + 1]]))
    return obj


def accepts(fn: object, keyword: str) -> bool:
    """Whether ``fn`` takes ``keyword``: its signature, or for a C function the one its
    docstring opens with."""
    try:
        return keyword in inspect.signature(fn).parameters  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return re.search(rf"\b{keyword}\s*=", (fn.__doc__ or "")[:600]) is not None


def method_uses(attr: str, keywords: list[str]) -> set[str]:
    """'Owner.attr' and 'Owner.attr(kw=)' for a call x.attr(..., kw=...) of a torch method name.
    Keywords count where torch's method takes them (``ax.scatter(color=)`` is matplotlib's). A
    name that built-in types also have (``sort``, ``split``, ``add``) counts only through a
    keyword torch's method takes and theirs do not (``x.sort(stable=True)``, not ``xs.sort()``)."""
    owners = [(owner, getattr(cls, attr)) for owner, cls in _METHOD_OWNERS.items()
              if hasattr(cls, attr)]
    ours = {kw: [owner for owner, method in owners if takes(method, kw)] for kw in keywords}
    if attr in _BUILTIN_NAMES:
        ours = {kw: found for kw, found in ours.items() if found and not _builtin_takes(attr, kw)}
        if not ours:
            return set()
    return ({f"{owner}.{attr}" for owner, _ in owners}
            | {f"{owner}.{attr}({kw}=)" for kw, found in ours.items() for owner in found})


def _builtin_takes(attr: str, keyword: str) -> bool:
    methods = [getattr(t, attr) for t in (str, bytes, list, dict, set, tuple, int, float)
               if hasattr(t, attr)]
    return any(accepts(method, keyword) for method in methods)


def takes(method: object, keyword: str) -> bool:
    """Whether a torch method may take ``keyword``: its signature (``**kwargs`` too, as
    ``Module.to``'s), the operator schemas of the ATen op of its name (every overload, so
    ``Tensor.cumsum``'s ``dim``, which its docstring shows without a default), or its docstring."""
    try:
        params = inspect.signature(method).parameters.values()  # type: ignore[arg-type]
        return any(p.name == keyword or p.kind is p.VAR_KEYWORD for p in params)
    except (TypeError, ValueError):
        pass
    name = getattr(method, "__name__", "")
    try:
        schemas = torch._C._jit_get_schemas_for_operator(f"aten::{name}")
    except (AttributeError, RuntimeError):
        schemas = []
    if any(arg.name == keyword for schema in schemas for arg in schema.arguments):
        return True
    return accepts(method, keyword) or "**kwargs" in (method.__doc__ or "")[:200]


def test_every_torch_api_used_is_filed():
    used, known = used_apis(), baseline() | set(SINCE)
    new = {api: sorted(files) for api, files in used.items() if api not in known}
    assert not new, (
        "torch APIs used but neither in SINCE (with the release they appeared in) nor in "
        f"tests/torch_api_baseline.txt (torch 2.0 or older): {new}. Look the version up in "
        "torch's release notes; if it is newer than the floor in requirements.txt, raise the "
        "floor or guard the use (GUARDED).")


def test_since_entries_are_used_and_exist():
    used = used_apis()
    stale = sorted(api for api in SINCE if api not in used)
    assert not stale, f"SINCE lists APIs nothing uses any more: {stale}"
    for api in SINCE:
        if api in PROBES:
            assert PROBES[api](), f"the installed torch lacks {api}"
            continue
        obj = resolve(api)
        if api.endswith("=)"):
            keyword = api.split("(")[1][:-2]
            assert accepts(obj, keyword) or takes(obj, keyword), (
                f"{api.split('(')[0]} takes no {keyword}=")


def test_guards_are_in_place():
    texts = sources()
    for api, (path, check) in GUARDED.items():
        assert check in texts[path], f"{api} is listed as guarded, but {path} lacks {check!r}"
        assert all(path_ == path for path_ in used_apis().get(api, {path})), (
            f"{api} is used outside its guarded place {path}")


def test_floor_covers_what_the_chapters_need():
    need = max(Version(v) for api, (v, _) in SINCE.items() if api not in GUARDED)
    newest = [api for api, (v, _) in SINCE.items() if Version(v) == need]
    assert floor() >= need, f"requirements.txt's torch floor {floor()} < {need} ({newest})"
    assert Version(torch.__version__.split("+")[0]) >= floor()
    # transformers switches PyTorch off below its own minimum: the floor is at least that
    wants = [Requirement(r) for r in metadata.requires("transformers") or []
             if Requirement(r).name == "torch"]
    assert wants, "transformers states no torch requirement any more"
    for req in wants:
        lows = [Version(s.version) for s in req.specifier if s.operator == ">="]
        assert all(floor() >= low for low in lows), (
            f"transformers {metadata.version('transformers')} requires {req}; requirements.txt "
            f"says torch>={floor()}")


def test_takes_sees_keywords_a_docstring_hides():
    """A late method keyword filed in SINCE must pass the existence check that the scan's own
    test (takes) passes: Tensor.sort's docstring omits stable=, its ATen schema has it."""
    assert takes(torch.Tensor.sort, "stable") and takes(torch.Tensor.cumsum, "dim")
    assert not takes(torch.Tensor.sort, "colour")


@pytest.mark.parametrize("source, expected", [
    ("import torch.nn.functional as F\nF.rms_norm(x, (4,))", {"torch.nn.functional.rms_norm"}),
    ("from torch import nn\nnn.RMSNorm(4, eps=1e-6)", {"torch.nn.RMSNorm",
                                                      "torch.nn.RMSNorm(eps=)"}),
    ("import torch\nx.untyped_storage()", {"Tensor.untyped_storage"}),
    ("from torch.nn.attention import sdpa_kernel\nsdpa_kernel(b)",
     {"torch.nn.attention.sdpa_kernel"}),
    ("import numpy as np\nnp.zeros(3)", set()),
    ("y = x.mT @ x\nprint(x.nbytes)", {"Tensor.mT", "Tensor.nbytes"}),
    ("m.load_state_dict(sd, assign=True)", {"Module.load_state_dict", "Optimizer.load_state_dict",
                                            "Module.load_state_dict(assign=)"}),
    ("ax.scatter(x, y, color='k')", {"Tensor.scatter"}),
    ("y = x.mT.contiguous()\nn = x.nbytes.bit_length()", {"Tensor.mT", "Tensor.contiguous",
                                                          "Tensor.nbytes"}),
    ("x.sort(dim=-1, stable=True)\nxs.sort(reverse=True)\nparts.split(',')",
     {"Tensor.sort", "Tensor.sort(dim=)", "Tensor.sort(stable=)"}),
    ("x.cumsum(dim=0)", {"Tensor.cumsum", "Tensor.cumsum(dim=)"}),
    ("import numpy as np\nprint(np.ndim(a))", set()),
])
def test_the_scan_sees_a_use(source, expected):
    """The scan is the test's eyes: a late API in any spelling must show up in it."""
    assert torch_apis(source) == expected
