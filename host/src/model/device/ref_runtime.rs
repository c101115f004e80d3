//! A test-only [`Runtime`] that runs every kernel the device forward launches with its CPU
//! reference from `kernels::cpu` (not the `.cu` sources: that is the simulator's job). It checks
//! the composition — launch order, buffer plumbing, per-token tables, slot mapping, gathers,
//! fused projections — against `LlamaModel`, on any machine.

use std::cell::RefCell;

use kernels::cpu;
use kernels::cuda::CudaError;
use kernels::gpu::{DevBuf, Dims, Elem, KArg, Runtime};

pub struct RefBuf<T>(RefCell<Vec<T>>);

impl<T> DevBuf for RefBuf<T> {
    fn len(&self) -> usize {
        self.0.borrow().len()
    }
}

pub struct RefRuntime;

/// The decode attention reference over the cache arguments of a paged attention or prefill
/// launch (`k`, `v` at 1 and 2, FP8 scales at 3 and 4), storage from the kernel's suffix.
#[allow(clippy::too_many_arguments)]
fn decode_reference(
    kernel: &str,
    a: Args<'_, '_>,
    q: &[f32],
    tables: &[i32],
    lens: &[i32],
    g: &cpu::attention::PagedGeometry,
    scale: f32,
    out: &mut [f32],
) {
    use cpu::attention::{paged_attention_decode, KvBlocks};
    if kernel.ends_with("_f32") {
        paged_attention_decode(
            q,
            &KvBlocks::F32 { k: &f32s(a, 1).borrow(), v: &f32s(a, 2).borrow() },
            tables,
            lens,
            g,
            scale,
            out,
        )
    } else if kernel.ends_with("_bf16") {
        paged_attention_decode(
            q,
            &KvBlocks::Bf16 { k: &u16s(a, 1).borrow(), v: &u16s(a, 2).borrow() },
            tables,
            lens,
            g,
            scale,
            out,
        )
    } else {
        let kv = KvBlocks::Fp8 {
            k: &u8s(a, 1).borrow(),
            v: &u8s(a, 2).borrow(),
            k_scales: &f32s(a, 3).borrow(),
            v_scales: &f32s(a, 4).borrow(),
        };
        paged_attention_decode(q, &kv, tables, lens, g, scale, out)
    }
}

type Args<'a, 'b> = &'a [KArg<'b, RefRuntime>];

fn f32s<'a>(a: Args<'a, '_>, i: usize) -> &'a RefCell<Vec<f32>> {
    match &a[i] {
        KArg::F32s(b) => &b.0,
        _ => panic!("argument {i} is not an f32 buffer"),
    }
}
fn i32s<'a>(a: Args<'a, '_>, i: usize) -> &'a RefCell<Vec<i32>> {
    match &a[i] {
        KArg::I32s(b) => &b.0,
        _ => panic!("argument {i} is not an i32 buffer"),
    }
}
fn u8s<'a>(a: Args<'a, '_>, i: usize) -> &'a RefCell<Vec<u8>> {
    match &a[i] {
        KArg::U8s(b) => &b.0,
        _ => panic!("argument {i} is not a u8 buffer"),
    }
}
fn u16s<'a>(a: Args<'a, '_>, i: usize) -> &'a RefCell<Vec<u16>> {
    match &a[i] {
        KArg::U16s(b) => &b.0,
        _ => panic!("argument {i} is not a u16 buffer"),
    }
}
fn int(a: Args<'_, '_>, i: usize) -> usize {
    match a[i] {
        KArg::I32(v) => v as usize,
        KArg::I64(v) => v as usize,
        _ => panic!("argument {i} is not an integer"),
    }
}
fn flt(a: Args<'_, '_>, i: usize) -> f32 {
    match a[i] {
        KArg::F32(v) => v,
        _ => panic!("argument {i} is not an f32"),
    }
}

fn widen(b: &[u16]) -> Vec<f32> {
    b.iter().map(|&x| half::bf16::from_bits(x).to_f32()).collect()
}

fn packed(a: Args<'_, '_>, bits: u32, rows: usize, cols: usize) -> cpu::bitpack::PackedRows {
    let stride = int(a, 1);
    cpu::bitpack::PackedRows::new(bits, rows, cols, stride, &u8s(a, 0).borrow()[..rows * stride])
}

impl Runtime for RefRuntime {
    type Buf<T: Elem> = RefBuf<T>;

    fn describe(&self) -> String {
        "CPU reference kernels".into()
    }
    fn upload<T: Elem>(&self, host: &[T]) -> Result<RefBuf<T>, CudaError> {
        Ok(RefBuf(RefCell::new(host.to_vec())))
    }
    fn download<T: Elem>(&self, buf: &RefBuf<T>) -> Result<Vec<T>, CudaError> {
        Ok(buf.0.borrow().clone())
    }
    fn zeros<T: Elem>(&self, n: usize) -> Result<RefBuf<T>, CudaError> {
        Ok(RefBuf(RefCell::new(vec![T::default(); n.max(1)])))
    }
    fn write<T: Elem>(&self, buf: &mut RefBuf<T>, offset: usize, host: &[T]) -> Result<(), CudaError> {
        buf.0.borrow_mut()[offset..offset + host.len()].copy_from_slice(host);
        Ok(())
    }
    fn synchronize(&self) -> Result<(), CudaError> {
        Ok(())
    }

    unsafe fn launch(&self, kernel: &'static str, dims: Dims, a: &[KArg<'_, Self>]) -> Result<(), CudaError> {
        match kernel {
            "gather_rows_f32" | "gather_rows_bf16" => {
                let (n, d) = (int(a, 3), int(a, 4));
                let rows = i32s(a, 1).borrow();
                let mut out = f32s(a, 2).borrow_mut();
                if kernel == "gather_rows_f32" {
                    cpu::gather::gather_rows(&f32s(a, 0).borrow(), &rows[..n], d, &mut out[..n * d]);
                } else {
                    cpu::gather::gather_rows_bf16(&u16s(a, 0).borrow(), &rows[..n], d, &mut out[..n * d]);
                }
            }
            "narrow_bf16" => {
                let n = int(a, 2);
                let b = cpu::gather::narrow_bf16(&f32s(a, 0).borrow()[..n]);
                u16s(a, 1).borrow_mut()[..n].copy_from_slice(&b);
            }
            "rms_norm" => {
                let (rows, d, eps) = (dims.grid.0 as usize, int(a, 3), flt(a, 4));
                cpu::norm::rms_norm(
                    &f32s(a, 0).borrow()[..rows * d],
                    &f32s(a, 1).borrow(),
                    eps,
                    &mut f32s(a, 2).borrow_mut()[..rows * d],
                );
            }
            "add_rms_norm" => {
                let (rows, d, eps) = (dims.grid.0 as usize, int(a, 4), flt(a, 5));
                cpu::norm::add_rms_norm(
                    &mut f32s(a, 0).borrow_mut()[..rows * d],
                    &f32s(a, 1).borrow()[..rows * d],
                    &f32s(a, 2).borrow(),
                    eps,
                    &mut f32s(a, 3).borrow_mut()[..rows * d],
                );
            }
            "rope_neox" => {
                let (tokens, heads, hd) = (int(a, 3), int(a, 4), int(a, 5));
                let rope = cpu::rope::Rope::from_inv_freq(f32s(a, 2).borrow().clone());
                let pos = i32s(a, 1).borrow();
                let mut x = f32s(a, 0).borrow_mut();
                for t in 0..tokens {
                    rope.apply(&mut x[t * heads * hd..(t + 1) * heads * hd], hd, pos[t] as usize);
                }
            }
            "silu_mul" => {
                let (tokens, d) = (int(a, 2), int(a, 3));
                let gu = f32s(a, 0).borrow();
                let mut out = f32s(a, 1).borrow_mut();
                for t in 0..tokens {
                    let row = &gu[t * 2 * d..(t + 1) * 2 * d];
                    cpu::activation::silu_mul(&row[..d], &row[d..], &mut out[t * d..(t + 1) * d]);
                }
            }
            "paged_attention_f32" | "paged_attention_bf16" | "paged_attention_fp8" => {
                let fp8 = kernel == "paged_attention_fp8";
                let o = if fp8 { 2 } else { 0 };
                let g = cpu::attention::PagedGeometry {
                    heads: int(a, 6 + o),
                    kv_heads: int(a, 7 + o),
                    head_dim: int(a, 8 + o),
                    block_size: int(a, 9 + o),
                    max_blocks: int(a, 10 + o),
                };
                let seqs = dims.grid.0 as usize;
                let (q, tables, lens, scale) =
                    (f32s(a, 0).borrow(), i32s(a, 3 + o).borrow(), i32s(a, 4 + o).borrow(), flt(a, 11 + o));
                let mut out = f32s(a, 5 + o).borrow_mut();
                let per = g.heads * g.head_dim;
                let (q, out, tables, lens) =
                    (&q[..seqs * per], &mut out[..seqs * per], &tables[..seqs * g.max_blocks], &lens[..seqs]);
                decode_reference(kernel, a, q, tables, lens, &g, scale, out);
            }
            "paged_prefill_f32"
            | "paged_prefill_bf16"
            | "paged_prefill_fp8"
            | "paged_flash_prefill_bf16"
            | "paged_flash_prefill_fp8" => {
                // Each tile row by the decode reference with its own table and length (exact: the
                // tensor-core kernel's bf16 rounding of Q and P is the device's, not the model's).
                let o = if kernel.ends_with("fp8") { 2 } else { 0 };
                let g = cpu::attention::PagedGeometry {
                    heads: int(a, 7 + o),
                    kv_heads: int(a, 8 + o),
                    head_dim: int(a, 9 + o),
                    block_size: int(a, 10 + o),
                    max_blocks: int(a, 11 + o),
                };
                let (q, tables, lens, tiles, scale) = (
                    f32s(a, 0).borrow(),
                    i32s(a, 3 + o).borrow(),
                    i32s(a, 4 + o).borrow(),
                    i32s(a, 5 + o).borrow(),
                    flt(a, 12 + o),
                );
                let mut out = f32s(a, 6 + o).borrow_mut();
                let (per, mb) = (g.heads * g.head_dim, g.max_blocks);
                for tile in tiles[..2 * dims.grid.0 as usize].chunks(2) {
                    for r in tile[0] as usize..(tile[0] + tile[1]) as usize {
                        let (q, out, tables, lens) = (
                            &q[r * per..(r + 1) * per],
                            &mut out[r * per..(r + 1) * per],
                            &tables[r * mb..(r + 1) * mb],
                            &lens[r..r + 1],
                        );
                        decode_reference(kernel, a, q, tables, lens, &g, scale, out);
                    }
                }
            }
            "kv_write_f32" | "kv_write_bf16" => {
                let (n, w) = (int(a, 5), int(a, 6));
                let (k, v, slots) = (f32s(a, 0).borrow(), f32s(a, 1).borrow(), i32s(a, 2).borrow());
                let (k, v, slots) = (&k[..n * w], &v[..n * w], &slots[..n]);
                if kernel == "kv_write_f32" {
                    cpu::kv_write::kv_write_f32(
                        k,
                        v,
                        slots,
                        w,
                        &mut f32s(a, 3).borrow_mut(),
                        &mut f32s(a, 4).borrow_mut(),
                    );
                } else {
                    cpu::kv_write::kv_write_bf16(
                        k,
                        v,
                        slots,
                        w,
                        &mut u16s(a, 3).borrow_mut(),
                        &mut u16s(a, 4).borrow_mut(),
                    );
                }
            }
            "kv_write_fp8" => {
                let (n, kvh, hd) = (int(a, 7), int(a, 8), int(a, 9));
                let (k, v, slots) = (f32s(a, 0).borrow(), f32s(a, 1).borrow(), i32s(a, 2).borrow());
                let (mut kc, mut vc, mut ks, mut vs) =
                    (u8s(a, 3).borrow_mut(), u8s(a, 4).borrow_mut(), f32s(a, 5).borrow_mut(), f32s(a, 6).borrow_mut());
                cpu::kv_write::kv_write_fp8(
                    &k[..n * kvh * hd],
                    &v[..n * kvh * hd],
                    &slots[..n],
                    kvh,
                    hd,
                    &mut kc,
                    &mut vc,
                    &mut ks,
                    &mut vs,
                );
            }
            "copy_span_f32" => {
                let (s, d, n) = (int(a, 1), int(a, 2), int(a, 3));
                f32s(a, 0).borrow_mut().copy_within(s..s + n, d);
            }
            "copy_span_u16" => {
                let (s, d, n) = (int(a, 1), int(a, 2), int(a, 3));
                u16s(a, 0).borrow_mut().copy_within(s..s + n, d);
            }
            "copy_span_u8" => {
                let (s, d, n) = (int(a, 1), int(a, 2), int(a, 3));
                u8s(a, 0).borrow_mut().copy_within(s..s + n, d);
            }
            "int_gemv" | "int4_gemv" | "cubic_gemv" => {
                let (rows, cols) = (int(a, 6), int(a, 7));
                let (bits, group, n) = if kernel == "int4_gemv" {
                    (4, int(a, 8), int(a, 9))
                } else {
                    (int(a, 8) as u32, int(a, 9), int(a, 10))
                };
                let p = packed(a, bits, rows, cols);
                let (p0, p1) = (f32s(a, 2).borrow(), f32s(a, 3).borrow());
                let (x, mut out) = (f32s(a, 4).borrow(), f32s(a, 5).borrow_mut());
                let (x, out) = (&x[..n * cols], &mut out[..n * rows]);
                if kernel == "cubic_gemv" {
                    cpu::cubic::AnyCubic::new(p, group, &p0, &p1).matmul_t(x, out, n);
                } else {
                    cpu::quant_int::IntMatrix::new(p, group, &p0, &p1).matmul_t(x, out, n);
                }
            }
            "matmul_f32" => {
                let (rows, cols, n) = (int(a, 3), int(a, 4), int(a, 5));
                cpu::matmul::matmul_t(
                    &f32s(a, 1).borrow()[..n * cols],
                    &f32s(a, 0).borrow()[..rows * cols],
                    &mut f32s(a, 2).borrow_mut()[..n * rows],
                    n,
                    cols,
                    rows,
                );
            }
            "mxfp4_gemv" => {
                let (rows, cols, n) = (int(a, 4), int(a, 5), int(a, 6));
                let m = cpu::mxfp4::Mxfp4Matrix::new(
                    rows,
                    cols,
                    &u8s(a, 0).borrow()[..rows * cols / 2],
                    &u8s(a, 1).borrow(),
                );
                m.matmul_t(&f32s(a, 2).borrow()[..n * cols], &mut f32s(a, 3).borrow_mut()[..n * rows], n);
            }
            other => return Err(CudaError::BadArgs(format!("the reference runtime has no kernel {other}"))),
        }
        Ok(())
    }

    fn gemm_bf16(
        &self,
        x: &RefBuf<u16>,
        w: &RefBuf<u16>,
        w_row0: usize,
        out: &mut RefBuf<f32>,
        n: usize,
        k: usize,
        m: usize,
    ) -> Result<(), CudaError> {
        let (x, w) = (widen(&x.0.borrow()[..n * k]), widen(&w.0.borrow()[w_row0 * k..(w_row0 + m) * k]));
        cpu::matmul::matmul_t(&x, &w, &mut out.0.borrow_mut()[..n * m], n, k, m);
        Ok(())
    }
}

/// [`RefRuntime`] whose `fail_at`-th kernel launch (counting from 0) fails, as a device error
/// would: to test what a failure in the middle of a step does.
pub struct Flaky {
    launches: std::sync::atomic::AtomicUsize,
    fail_at: usize,
}

impl Flaky {
    pub fn new(fail_at: usize) -> Self {
        Self { launches: 0.into(), fail_at }
    }
}

impl Runtime for Flaky {
    type Buf<T: Elem> = RefBuf<T>;

    fn describe(&self) -> String {
        "CPU reference kernels with an injected failure".into()
    }
    fn upload<T: Elem>(&self, host: &[T]) -> Result<RefBuf<T>, CudaError> {
        RefRuntime.upload(host)
    }
    fn download<T: Elem>(&self, buf: &RefBuf<T>) -> Result<Vec<T>, CudaError> {
        RefRuntime.download(buf)
    }
    fn zeros<T: Elem>(&self, n: usize) -> Result<RefBuf<T>, CudaError> {
        RefRuntime.zeros(n)
    }
    fn write<T: Elem>(&self, buf: &mut RefBuf<T>, offset: usize, host: &[T]) -> Result<(), CudaError> {
        RefRuntime.write(buf, offset, host)
    }
    fn synchronize(&self) -> Result<(), CudaError> {
        Ok(())
    }
    unsafe fn launch(&self, kernel: &'static str, dims: Dims, a: &[KArg<'_, Self>]) -> Result<(), CudaError> {
        if self.launches.fetch_add(1, std::sync::atomic::Ordering::Relaxed) == self.fail_at {
            return Err(CudaError::Driver { what: kernel, msg: "injected launch failure".into() });
        }
        let args: Vec<KArg<'_, RefRuntime>> = a
            .iter()
            .map(|x| match *x {
                KArg::F32s(b) => KArg::F32s(b),
                KArg::I32s(b) => KArg::I32s(b),
                KArg::U8s(b) => KArg::U8s(b),
                KArg::U16s(b) => KArg::U16s(b),
                KArg::I32(v) => KArg::I32(v),
                KArg::I64(v) => KArg::I64(v),
                KArg::F32(v) => KArg::F32(v),
            })
            .collect();
        // SAFETY: the caller's guarantee for `a`, which `args` is element for element.
        unsafe { RefRuntime.launch(kernel, dims, &args) }
    }
    fn gemm_bf16(
        &self,
        x: &RefBuf<u16>,
        w: &RefBuf<u16>,
        w_row0: usize,
        out: &mut RefBuf<f32>,
        n: usize,
        k: usize,
        m: usize,
    ) -> Result<(), CudaError> {
        RefRuntime.gemm_bf16(x, w, w_row0, out, n, k, m)
    }
}
