"""Bit-exact fixtures for QuantTrio's Cubic format (tests/reference_cubic_pack.rs), made by their own
`pack_cubic_codes`, `unpack_cubic_codes`, `dequantize_cubic` and `materialize_cubic_a8_carrier`
and their test suite's `_reference_dynamic_a8_linear` (loaded by cubic_upstream.py from a checkout of
QuantTrio/vllm-cubic).

For every width 1-8 and both group_size forms ([1, g] and [group_out, group_in]), with row lengths
whose bit streams end mid-byte and last groups that are partial: random codes (the reserved raw
code written into some bytes by hand for b >= 2, which must read as 0), f32 scales, f16 a/b.
tests/reference/cubic_pack/cases.safetensors holds per case `weight_packed` U8, `weight_scale` F32,
`weight_a`/`weight_b` F16 (the checkpoint form), and their `codes` (I8), `dequant` (F32) and
`a8_carrier` (I8, where the rows fill whole output groups), and for [1, g] groups three input rows
`a8_x` with their dynamic-A8 reference linear's output `a8_out` (`_reference_dynamic_a8_linear`
from their tests/quantization/test_cubic_dynamic_a8.py); cases.json the shapes.

Run: VLLM_CUBIC_SRC=<checkout> .venv/bin/python tests/reference/make_cubic_pack.py
"""
import json
import os

import torch
from safetensors.torch import save_file

import cubic_upstream

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "cubic_pack")


def main():
    up = cubic_upstream.load()
    g = torch.Generator().manual_seed(5)
    tensors, cases = {}, []
    for bits in range(1, 9):
        for (go, gi), (rows, cols) in [((1, 32), (3, 77)), ((2, 16), (5, 40))]:
            name = f"b{bits}_g{go}x{gi}"
            m = (1 << (bits - 1)) - 1
            if bits == 1:
                codes = torch.randint(0, 2, (rows, cols), generator=g) * 2 - 1
            else:
                codes = torch.randint(-m, m + 1, (rows, cols), generator=g)
            packed = up["pack_cubic_codes"](codes, bits)
            if bits >= 2:
                # Write the reserved raw code (-2^(b-1)) into element 1 of row 0 by hand: it must read as 0.
                raw = list(packed[0].tolist())
                pos = 1 * bits
                value = 1 << (bits - 1)
                for j in range(bits):
                    byte, shift = (pos + j) // 8, (pos + j) % 8
                    raw[byte] = (raw[byte] & ~(1 << shift)) | (((value >> j) & 1) << shift)
                packed[0] = torch.tensor(raw, dtype=torch.uint8)
            groups = ((rows + go - 1) // go, (cols + gi - 1) // gi)
            scale = torch.rand(groups, generator=g) * 0.1 + 0.01
            a = (torch.rand(groups, generator=g) * 1.3 + 0.2).half()
            b = (torch.rand(groups, generator=g) - 0.5).half()
            unpacked = up["unpack_cubic_codes"](packed, bits, cols)
            deq = up["dequantize_cubic"](packed, scale, a, b, total_bits=bits, group_size=gi, group_out=go,
                                         num_values=cols)
            out = {"weight_packed": packed, "weight_scale": scale, "weight_a": a, "weight_b": b,
                   "codes": unpacked, "dequant": deq}
            if go == 1:  # their A8 reference linear takes [1, g] groups
                x = torch.randn(3, cols, generator=g) * 2.0
                out["a8_x"] = x
                out["a8_out"] = up["_reference_dynamic_a8_linear"](x, packed, scale, a, b, bits, gi)
            if rows % go == 0:  # their carrier needs whole output groups
                out["a8_carrier"] = up["materialize_cubic_a8_carrier"](packed, a, b, num_bits=bits, group_size=gi,
                                                                       input_size=cols, group_out=go)
            for k, v in out.items():
                tensors[f"{name}.{k}"] = v.contiguous()
            cases.append({"name": name, "bits": bits, "group_out": go, "group_in": gi, "rows": rows, "cols": cols})
    os.makedirs(OUT, exist_ok=True)
    save_file(tensors, os.path.join(OUT, "cases.safetensors"))
    with open(os.path.join(OUT, "cases.json"), "w") as f:
        json.dump({"source": "QuantTrio/vllm-cubic cubic.py (413ca1c)", "cases": cases}, f, indent=1)
    print(len(cases), "cases,", os.path.getsize(os.path.join(OUT, "cases.safetensors")), "bytes")


if __name__ == "__main__":
    main()
