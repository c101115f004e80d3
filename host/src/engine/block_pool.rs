//! The paged KV pool: fixed-size blocks in one preallocated allocation, reference-counted, with
//! an automatic prefix cache.
//!
//! A full block can be registered under a hash of (parent block hash, salt, its token ids). When
//! its last user lets go it is not freed but parked in an LRU list, so a later request with the
//! same prefix (and salt) picks it up without recomputing; allocation evicts the least recently
//! used parked block only when no free block is left.

use std::collections::{HashMap, VecDeque};
use std::hash::{Hash, Hasher};

use kernels::cpu::fp8::quantize_e4m3;

use super::recurrent_slots::RecurrentSlots;
use crate::model::kv::{BlockCopy, CacheLayout, KvRow, LayerKvShape};

pub type BlockId = u32;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvDtype {
    F32,
    /// bf16, rounded to nearest even: half the bytes of f32, 8 mantissa bits.
    Bf16,
    Fp8E4m3,
}

impl KvDtype {
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "f32" | "float32" => Ok(Self::F32),
            "bf16" | "bfloat16" => Ok(Self::Bf16),
            // vLLM-cubic's `fp8_q16`: FP8 K/V with the queries kept in the model dtype, which is
            // how every FP8 cache here works (queries are never quantized).
            "fp8" | "fp8_e4m3" | "fp8_q16" => Ok(Self::Fp8E4m3),
            other => Err(format!("unknown KV cache dtype '{other}' (expected auto, f32, bf16, fp8 or fp8_q16)")),
        }
    }

    /// The layout of a device pool holding this dtype.
    pub fn device_storage(self) -> kernels::gpu::kv_pool::KvStorage {
        use kernels::gpu::kv_pool::KvStorage;
        match self {
            Self::F32 => KvStorage::F32,
            Self::Bf16 => KvStorage::Bf16,
            Self::Fp8E4m3 => KvStorage::Fp8,
        }
    }
}

/// `--kv-cache-dtype`: a storage type, or `auto`, the type the forward computes in (vLLM's auto:
/// the model's dtype), known once the model is placed: bf16 for a device forward holding its
/// dense weights in bf16 (`--dtype bfloat16`, the default), f32 on the CPU (whose forward is f32)
/// and with `--dtype float32`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvCacheDtype {
    Auto,
    Fixed(KvDtype),
}

impl KvCacheDtype {
    pub fn parse(s: &str) -> Result<Self, String> {
        if s == "auto" {
            Ok(Self::Auto)
        } else {
            KvDtype::parse(s).map(Self::Fixed)
        }
    }

    /// The storage type for a model whose forward runs on a device (`on_device`) with dense
    /// weights in `dense`.
    pub fn resolve(self, on_device: bool, dense: crate::model::device::weights::DenseWeights) -> KvDtype {
        use crate::model::device::weights::DenseWeights;
        match self {
            Self::Fixed(d) => d,
            Self::Auto if on_device && dense == DenseWeights::Bf16 => KvDtype::Bf16,
            Self::Auto => KvDtype::F32,
        }
    }
}

/// Geometry of the pool: what each layer keeps per token (from the model's `CacheLayout`) and
/// the tokens per block. Layers without a per-token cache take no space.
#[derive(Clone, Debug)]
pub struct PoolShape {
    pub layers: Vec<Option<LayerKvShape>>,
    pub block_size: usize,
}

impl PoolShape {
    pub fn new(layout: &CacheLayout, block_size: usize) -> Self {
        Self { layers: layout.layers.clone(), block_size }
    }

    /// Bytes one block takes (keys + values, all layers, scales included).
    pub fn block_bytes(&self, dtype: KvDtype) -> usize {
        let per_token: usize = self
            .layers
            .iter()
            .flatten()
            .map(|l| match dtype {
                KvDtype::F32 => (l.key_width + l.value_width) * 4,
                KvDtype::Bf16 => (l.key_width + l.value_width) * 2,
                KvDtype::Fp8E4m3 => l.key_width + l.value_width + 2 * l.groups * 4,
            })
            .sum();
        self.block_size * per_token
    }
}

/// Storage for one of K or V of one layer: `[block][slot][width]`, scales `[block][slot][groups]`.
enum Store {
    F32(Vec<f32>),
    /// bf16 bit patterns.
    Bf16(Vec<u16>),
    Fp8 {
        codes: Vec<u8>,
        scales: Vec<f32>,
    },
}

/// One layer's keys and values.
struct LayerStore {
    shape: LayerKvShape,
    keys: Store,
    values: Store,
}

impl LayerStore {
    fn new(shape: LayerKvShape, slots: usize, dtype: KvDtype) -> Self {
        let mk = |width: usize| match dtype {
            KvDtype::F32 => Store::F32(vec![0.0; slots * width]),
            KvDtype::Bf16 => Store::Bf16(vec![0; slots * width]),
            KvDtype::Fp8E4m3 => Store::Fp8 { codes: vec![0; slots * width], scales: vec![1.0; slots * shape.groups] },
        };
        Self { shape, keys: mk(shape.key_width), values: mk(shape.value_width) }
    }
}

impl Store {
    fn write(&mut self, i: usize, x: &[f32], groups: usize) {
        let w = x.len();
        match self {
            Store::F32(d) => d[i * w..(i + 1) * w].copy_from_slice(x),
            Store::Bf16(d) => {
                for (o, &v) in d[i * w..(i + 1) * w].iter_mut().zip(x) {
                    *o = half::bf16::from_f32(v).to_bits();
                }
            }
            Store::Fp8 { codes, scales } => {
                let g = w / groups;
                for h in 0..groups {
                    scales[i * groups + h] =
                        quantize_e4m3(&x[h * g..(h + 1) * g], &mut codes[i * w + h * g..i * w + (h + 1) * g]);
                }
            }
        }
    }

    fn row(&self, i: usize, w: usize, groups: usize) -> KvRow<'_> {
        match self {
            Store::F32(d) => KvRow::F32(&d[i * w..(i + 1) * w]),
            Store::Bf16(d) => KvRow::Bf16(&d[i * w..(i + 1) * w]),
            Store::Fp8 { codes, scales } => {
                KvRow::Fp8 { codes: &codes[i * w..(i + 1) * w], scales: &scales[i * groups..(i + 1) * groups] }
            }
        }
    }

    fn copy(&mut self, s: usize, d: usize, slots: usize, w: usize, groups: usize) {
        match self {
            Store::F32(x) => x.copy_within(s * w..(s + slots) * w, d * w),
            Store::Bf16(x) => x.copy_within(s * w..(s + slots) * w, d * w),
            Store::Fp8 { codes, scales } => {
                codes.copy_within(s * w..(s + slots) * w, d * w);
                scales.copy_within(s * groups..(s + slots) * groups, d * groups);
            }
        }
    }
}

pub type BlockHash = u64;

pub fn hash_block(parent: Option<BlockHash>, salt: &str, tokens: &[u32]) -> BlockHash {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    parent.hash(&mut h);
    salt.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

pub struct BlockPool {
    shape: PoolShape,
    num_blocks: usize,
    /// Per layer; `None` for layers without a per-token cache.
    stores: Vec<Option<LayerStore>>,
    refcount: Vec<u32>,
    free: Vec<BlockId>,
    /// Cached blocks nobody references, least recently used first.
    evictable: VecDeque<BlockId>,
    cached: HashMap<BlockHash, BlockId>,
    hash_of: Vec<Option<BlockHash>>,
    pub cache_queries: u64,
    pub cache_hits: u64,
    /// Fixed-size recurrent states lent to running sequences (empty for models without any).
    pub recurrent: RecurrentSlots,
    /// True when K/V live in the model's device pool: the host keeps block bookkeeping only.
    external: bool,
    /// Copy-on-write copies the device pool must apply before the next forward (external only).
    pending_copies: Vec<BlockCopy>,
}

impl BlockPool {
    pub fn new(shape: PoolShape, num_blocks: usize, dtype: KvDtype) -> Self {
        let slots = num_blocks * shape.block_size;
        let stores = shape.layers.iter().map(|l| l.map(|l| LayerStore::new(l, slots, dtype))).collect();
        Self {
            shape,
            num_blocks,
            stores,
            refcount: vec![0; num_blocks],
            free: (0..num_blocks as BlockId).rev().collect(),
            evictable: VecDeque::new(),
            cached: HashMap::new(),
            hash_of: vec![None; num_blocks],
            cache_queries: 0,
            cache_hits: 0,
            recurrent: RecurrentSlots::none(),
            external: false,
            pending_copies: Vec::new(),
        }
    }

    /// A pool whose K/V storage is the model's (on a device, under the same block ids): the
    /// host allocates no K/V memory, only the block bookkeeping (refcounts, prefix cache), and
    /// records copy-on-write copies for the model to apply ([`Self::take_pending_copies`]).
    pub fn new_external(shape: PoolShape, num_blocks: usize) -> Self {
        let mut p = Self::new(
            PoolShape { layers: vec![None; shape.layers.len()], block_size: shape.block_size },
            num_blocks,
            KvDtype::F32,
        );
        p.shape = shape;
        p.external = true;
        p
    }

    pub fn is_external(&self) -> bool {
        self.external
    }

    /// The copies recorded since the last call (always empty for a host-storage pool).
    pub fn take_pending_copies(&mut self) -> Vec<BlockCopy> {
        std::mem::take(&mut self.pending_copies)
    }

    /// Adds the recurrent-state slots sequences take beside their blocks.
    pub fn with_recurrent(mut self, slots: RecurrentSlots) -> Self {
        self.recurrent = slots;
        self
    }

    pub fn shape(&self) -> &PoolShape {
        &self.shape
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Blocks that can be handed out now (free plus evictable cached ones).
    pub fn available(&self) -> usize {
        self.free.len() + self.evictable.len()
    }

    /// Blocks not referenced by any sequence (the pool is "full" again when this equals the total).
    pub fn unreferenced(&self) -> usize {
        self.refcount.iter().filter(|&&r| r == 0).count()
    }

    pub fn refcount(&self, b: BlockId) -> u32 {
        self.refcount[b as usize]
    }

    pub fn allocate(&mut self) -> Option<BlockId> {
        let b = match self.free.pop() {
            Some(b) => b,
            None => {
                let b = self.evictable.pop_front()?;
                if let Some(h) = self.hash_of[b as usize].take() {
                    self.cached.remove(&h);
                }
                b
            }
        };
        self.refcount[b as usize] = 1;
        Some(b)
    }

    pub fn retain(&mut self, b: BlockId) {
        if self.refcount[b as usize] == 0 {
            // Revived from the evictable list by a prefix-cache hit.
            if let Some(i) = self.evictable.iter().position(|&x| x == b) {
                self.evictable.remove(i);
            }
        }
        self.refcount[b as usize] += 1;
    }

    pub fn release(&mut self, b: BlockId) {
        let r = &mut self.refcount[b as usize];
        debug_assert!(*r > 0, "double free of block {b}");
        *r -= 1;
        if *r == 0 {
            if self.hash_of[b as usize].is_some() {
                self.evictable.push_back(b);
            } else {
                self.free.push(b);
            }
        }
    }

    /// Looks up a cached block and takes a reference to it.
    pub fn lookup(&mut self, h: BlockHash) -> Option<BlockId> {
        self.cache_queries += 1;
        let b = *self.cached.get(&h)?;
        self.cache_hits += 1;
        self.retain(b);
        Some(b)
    }

    /// Registers a full block under its hash (first writer wins; duplicates stay uncached).
    pub fn register(&mut self, b: BlockId, h: BlockHash) {
        if self.hash_of[b as usize].is_none() && !self.cached.contains_key(&h) {
            self.cached.insert(h, b);
            self.hash_of[b as usize] = Some(h);
        }
    }

    fn slot_index(&self, block: BlockId, slot: usize) -> usize {
        block as usize * self.shape.block_size + slot
    }

    fn layer(&self, layer: usize) -> &LayerStore {
        self.stores[layer].as_ref().unwrap_or_else(|| panic!("layer {layer} keeps no per-token cache on the host"))
    }

    pub fn write(&mut self, layer: usize, block: BlockId, slot: usize, k: &[f32], v: &[f32]) {
        let i = self.slot_index(block, slot);
        let st = self.stores[layer].as_mut().unwrap_or_else(|| panic!("layer {layer} keeps no per-token cache"));
        debug_assert_eq!((k.len(), v.len()), (st.shape.key_width, st.shape.value_width), "layer {layer}: row widths");
        let groups = st.shape.groups;
        st.keys.write(i, k, groups);
        st.values.write(i, v, groups);
    }

    pub fn key(&self, layer: usize, block: BlockId, slot: usize) -> KvRow<'_> {
        let st = self.layer(layer);
        st.keys.row(self.slot_index(block, slot), st.shape.key_width, st.shape.groups)
    }

    pub fn value(&self, layer: usize, block: BlockId, slot: usize) -> KvRow<'_> {
        let st = self.layer(layer);
        st.values.row(self.slot_index(block, slot), st.shape.value_width, st.shape.groups)
    }

    /// Copies the first `slots` positions of every layer of `src` into `dst` (copy-on-write).
    pub fn copy_block(&mut self, src: BlockId, dst: BlockId, slots: usize) {
        if self.external {
            self.pending_copies.push(BlockCopy { src, dst, slots });
            return;
        }
        let (s, d) = (self.slot_index(src, 0), self.slot_index(dst, 0));
        for st in self.stores.iter_mut().flatten() {
            let LayerKvShape { key_width, value_width, groups } = st.shape;
            st.keys.copy(s, d, slots, key_width, groups);
            st.values.copy(s, d, slots, value_width, groups);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_kv_dtype_is_what_the_forward_computes_in() {
        use crate::model::device::weights::DenseWeights::{Bf16, F32};
        let auto = KvCacheDtype::parse("auto").unwrap();
        assert_eq!(auto.resolve(true, Bf16), KvDtype::Bf16, "a bf16 device forward");
        assert_eq!(auto.resolve(true, F32), KvDtype::F32, "--dtype float32 on a device");
        assert_eq!(auto.resolve(false, Bf16), KvDtype::F32, "the CPU forward");
        for (s, want) in [("f32", KvDtype::F32), ("bfloat16", KvDtype::Bf16), ("fp8", KvDtype::Fp8E4m3)] {
            assert_eq!(KvCacheDtype::parse(s).unwrap().resolve(true, Bf16), want, "{s} is kept");
            assert_eq!(KvCacheDtype::parse(s).unwrap().resolve(false, Bf16), want, "{s} is kept");
        }
        assert!(KvCacheDtype::parse("int8").unwrap_err().contains("expected auto, f32, bf16, fp8 or fp8_q16"));
    }

    fn pool(n: usize) -> BlockPool {
        BlockPool::new(PoolShape::new(&CacheLayout::uniform(2, LayerKvShape::heads(1, 4)), 2), n, KvDtype::F32)
    }

    #[test]
    fn cached_blocks_survive_release_and_are_evicted_last() {
        let mut p = pool(2);
        let a = p.allocate().unwrap();
        let h = hash_block(None, "t", &[1, 2]);
        p.register(a, h);
        p.release(a);
        assert_eq!(p.available(), 2);
        assert_eq!(p.lookup(h), Some(a));
        assert_eq!(p.refcount(a), 1);
        p.release(a);
        let b = p.allocate().unwrap();
        assert_ne!(a, b, "free blocks are used before cached ones are evicted");
        let c = p.allocate().unwrap();
        assert_eq!(c, a);
        assert_eq!(p.lookup(h), None, "evicted block left the cache");
        assert!(p.allocate().is_none());
    }

    #[test]
    fn salt_separates_cache_entries() {
        assert_ne!(hash_block(None, "a", &[1, 2]), hash_block(None, "b", &[1, 2]));
        assert_ne!(hash_block(Some(1), "a", &[1, 2]), hash_block(Some(2), "a", &[1, 2]));
    }

    #[test]
    fn layers_of_different_widths_share_block_ids() {
        let layout = CacheLayout {
            layers: vec![
                Some(LayerKvShape { key_width: 6, value_width: 2, groups: 2 }),
                None,
                Some(LayerKvShape::heads(1, 4)),
            ],
            recurrent_bytes_per_seq: 0,
        };
        let shape = PoolShape::new(&layout, 2);
        assert_eq!(shape.block_bytes(KvDtype::F32), 2 * (8 + 8) * 4);
        assert_eq!(shape.block_bytes(KvDtype::Bf16), 2 * (8 + 8) * 2);
        assert_eq!(shape.block_bytes(KvDtype::Fp8E4m3), 2 * ((8 + 2 * 2 * 4) + (8 + 2 * 4)));
        for dtype in [KvDtype::F32, KvDtype::Bf16, KvDtype::Fp8E4m3] {
            let mut p = BlockPool::new(shape.clone(), 3, dtype);
            let (a, b) = (p.allocate().unwrap(), p.allocate().unwrap());
            p.write(0, a, 1, &[1.0, 2.0, 3.0, -1.0, -2.0, -3.0], &[0.5, 0.25]);
            p.write(2, a, 1, &[4.0; 4], &[8.0; 4]);
            p.copy_block(a, b, 2);
            let q = [1.0f32; 3];
            // E4M3 keeps 3 mantissa bits: a few percent of error per element.
            let got = p.key(0, b, 1).dot_span(3, &q);
            assert!((got + 6.0).abs() < 0.3, "{dtype:?} {got}");
            assert!((p.value(2, b, 1).dot_span(0, &[1.0; 4]) - 32.0).abs() < 0.5, "{dtype:?}");
        }
    }
}
