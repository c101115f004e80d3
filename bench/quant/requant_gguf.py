"""llama.cpp's Q4_0 / Q4_1 of the bf16 baseline, made with gguf-py's ports of ggml's reference
quantizers (`gguf.quants.quantize`, the same block formulas as ggml's quantize_row_q4_0_ref /
quantize_row_q4_1_ref).

    .venv/bin/python bench/quant/requant_gguf.py models/SmolLM2-135M-Instruct.Q4_1.gguf Q4_0 /tmp/qw/q4_0.gguf

The baseline is the same one bench/quant/gguf_to_hf.py writes: every tensor of the source GGUF
dequantised and rounded to bf16. Here the 2-D Linear weights of that baseline are quantized to the
requested type; the token embedding (tied to the output head) is stored as BF16 and the norms as
F32, exactly the baseline values, so the GGUF rows differ from the bf16 row only in the Linear
layers, as the `wasmserve quantize` rows do. Metadata (tokenizer, hyper-parameters) is copied.
"""
import sys

import numpy as np
import torch
import gguf
from gguf import GGMLQuantizationType as T


def bf16_round(a: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.array(a, dtype=np.float32, copy=True)).to(torch.bfloat16).float().numpy()


def main(src: str, qtype: str, dst: str):
    target = T[qtype]
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(dst, arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        vt = f.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            w.add_key_value(name, f.contents(), vt, sub_type=f.types[-1])
        else:
            w.add_key_value(name, f.contents(), vt)
    w.add_file_type({T.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0, T.Q4_1: gguf.LlamaFileType.MOSTLY_Q4_1}[target])
    for t in r.tensors:
        # gguf-py's numpy shape is the reverse of ggml's ne: (rows, cols) for a 2-D weight.
        shape = [int(d) for d in reversed(t.shape)]
        values = bf16_round(gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape))
        if len(shape) == 2 and name_is_linear(t.name):
            data, ty = gguf.quants.quantize(values, target), target
        elif len(shape) == 2:
            data, ty = gguf.quants.quantize(values, T.BF16), T.BF16
        else:
            data, ty = values.astype(np.float32), T.F32
        w.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=ty)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print("wrote", dst, qtype)


def name_is_linear(name: str) -> bool:
    return name.startswith("blk.") and name.endswith(".weight") and "norm" not in name


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
