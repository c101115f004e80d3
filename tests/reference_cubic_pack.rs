//! QuantTrio's Cubic format read as their code reads it: for every width 1-8, both group_size
//! forms, rows ending mid-byte, partial groups and the reserved code, our unpacked codes and A16
//! dequantised weights equal the outputs of their `unpack_cubic_codes` / `dequantize_cubic` bit
//! for bit (tests/reference/make_cubic_pack.py, from QuantTrio/vllm-cubic 413ca1c), loading the
//! tensors through the checkpoint loader. (The A8 carriers in the fixture wait for the dynamic-A8
//! kernels.)

mod common;

use safetensors::SafeTensors;
use wasmserve::model::format::hf_source::SafetensorsSource;
use wasmserve::model::format::quant::cubic_pack::{load_cubic_pack, CubicScheme};

#[test]
fn codes_and_dequantised_weights_equal_the_authors_functions_bit_for_bit() {
    let dir = common::repo_root().join("tests/reference/cubic_pack");
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("cases.json")).unwrap()).unwrap();
    let bytes = std::fs::read(dir.join("cases.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let src = SafetensorsSource::open(&dir).unwrap();
    let cases = meta["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 16);
    for c in cases {
        let name = c["name"].as_str().unwrap();
        let u = |k: &str| c[k].as_u64().unwrap() as usize;
        let (rows, cols) = (u("rows"), u("cols"));
        let scheme = CubicScheme { bits: u("bits") as u32, group_out: u("group_out"), group_in: u("group_in") };
        let m = load_cubic_pack(&src, name, rows, cols, scheme).unwrap_or_else(|e| panic!("{name}: {e}"));
        let codes: Vec<i32> =
            st.tensor(&format!("{name}.codes")).unwrap().data().iter().map(|&b| b as i8 as i32).collect();
        let deq: Vec<u32> = st
            .tensor(&format!("{name}.dequant"))
            .unwrap()
            .data()
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        for r in 0..rows {
            assert_eq!(m.codes_row(r), codes[r * cols..(r + 1) * cols], "{name}: codes of row {r}");
            let ours: Vec<u32> = m.dequantize_row(r).iter().map(|v| v.to_bits()).collect();
            assert_eq!(ours, deq[r * cols..(r + 1) * cols], "{name}: dequantised row {r}");
        }
    }
}
