//! QuantTrio's Cubic format read as their code reads it: for every width 1-8, both group_size
//! forms, rows ending mid-byte, partial groups and the reserved code, our unpacked codes and A16
//! dequantised weights equal the outputs of their `unpack_cubic_codes` / `dequantize_cubic` bit
//! for bit (tests/reference/make_cubic_pack.py, from QuantTrio/vllm-cubic 413ca1c), loading the
//! tensors through the checkpoint loader; in dynamic-A8 mode our int8 carriers equal their
//! `materialize_cubic_a8_carrier`'s bit for bit and our A8 products their test suite's
//! `_reference_dynamic_a8_linear`.

mod common;

use safetensors::SafeTensors;
use wasmserve::model::format::hf_source::SafetensorsSource;
use wasmserve::model::format::quant::cubic_pack::{load_cubic_pack, CubicScheme};

#[test]
fn codes_dequantised_weights_and_a8_equal_the_authors_functions() {
    let dir = common::repo_root().join("tests/reference/cubic_pack");
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("cases.json")).unwrap()).unwrap();
    let bytes = std::fs::read(dir.join("cases.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let src = SafetensorsSource::open(&dir).unwrap();
    let cases = meta["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 16);
    let (mut carriers, mut a8_cases, mut worst_a8) = (0, 0, 0.0f32);
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
        if let Ok(t) = st.tensor(&format!("{name}.a8_carrier")) {
            let want: Vec<i8> = t.data().iter().map(|&b| b as i8).collect();
            for r in 0..rows {
                assert_eq!(m.carrier_row(r), want[r * cols..(r + 1) * cols], "{name}: A8 carriers of row {r}");
            }
            carriers += 1;
        }
        if let Ok(t) = st.tensor(&format!("{name}.a8_x")) {
            let f32s = |b: &[u8]| -> Vec<f32> {
                b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
            };
            let x = f32s(t.data());
            let want = f32s(st.tensor(&format!("{name}.a8_out")).unwrap().data());
            let n = x.len() / cols;
            let a8 = load_cubic_pack(&src, name, rows, cols, scheme).unwrap().with_a8();
            let mut got = vec![0.0f32; n * rows];
            a8.matmul_t(&x, &mut got, n);
            let scale = want.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
            let worst = kernels::compare::max_abs_error(&got, &want) / scale;
            worst_a8 = worst_a8.max(worst);
            // Integer group sums are exact in f32 on both sides; what differs is only how torch's
            // f32 matmul adds them (measured 0 here) — allow a few ulps.
            assert!(worst <= 1e-6, "{name}: A8 product differs from their reference by {worst} of {scale}");
            a8_cases += 1;
        }
    }
    assert!(carriers >= 8 && a8_cases == 8, "{carriers} carrier cases, {a8_cases} A8 cases");
    eprintln!("dynamic A8 vs their reference: worst {worst_a8:.2e} relative");
}
