"""QuantTrio's own pure-torch Cubic functions, loaded from a copy of their source without importing
vLLM: the function definitions are taken out of `cubic.py` by name (ast) and run in a namespace
holding torch and math. Nothing of theirs is committed; point VLLM_CUBIC_SRC at a checkout of
https://github.com/QuantTrio/vllm-cubic (checked at 413ca1c, 2026-08-21), e.g.

    git clone https://github.com/QuantTrio/vllm-cubic /tmp/vllm-cubic
    VLLM_CUBIC_SRC=/tmp/vllm-cubic .venv/bin/python tests/reference/make_cubic_pack.py
"""
import ast
import math
import os

import torch

FUNCTIONS = ["cubic_levels", "pack_cubic_codes", "unpack_cubic_codes", "dequantize_cubic",
             "materialize_cubic_a8_carrier"]


def load():
    root = os.environ.get("VLLM_CUBIC_SRC")
    if not root:
        raise SystemExit("set VLLM_CUBIC_SRC to a checkout of QuantTrio/vllm-cubic")
    qdir = os.path.join(root, "vllm/model_executor/layers/quantization")
    ns = {"torch": torch, "math": math}
    policy = ast.parse(open(os.path.join(qdir, "cubic_policy.py")).read())
    for node in policy.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "CUBIC_SUPPORTED_BITS" for t in node.targets):
            exec(compile(ast.Module([node], []), "cubic_policy.py", "exec"), ns)
    tree = ast.parse(open(os.path.join(qdir, "cubic.py")).read())
    found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in FUNCTIONS]
    missing = set(FUNCTIONS) - {n.name for n in found}
    if missing:
        raise SystemExit(f"cubic.py no longer defines {sorted(missing)}")
    exec(compile(ast.Module(found, []), "cubic.py", "exec"), ns)
    # Their dynamic-A8 reference linear, from their test file (it calls unpack_cubic_codes).
    tests = ast.parse(open(os.path.join(root, "tests/quantization/test_cubic_dynamic_a8.py")).read())
    a8 = [n for n in tests.body if isinstance(n, ast.FunctionDef)
          and n.name in ("_reference_carriers", "_reference_dynamic_a8_linear")]
    if len(a8) != 2:
        raise SystemExit("test_cubic_dynamic_a8.py no longer defines the A8 reference")
    exec(compile(ast.Module(a8, []), "test_cubic_dynamic_a8.py", "exec"), ns)
    return ns
