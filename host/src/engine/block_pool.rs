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

use crate::model::kv::KvRow;

pub type BlockId = u32;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvDtype {
    F32,
    Fp8E4m3,
}

impl KvDtype {
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "auto" | "f32" | "float32" => Ok(Self::F32),
            "fp8" | "fp8_e4m3" => Ok(Self::Fp8E4m3),
            other => Err(format!("unknown KV cache dtype '{other}' (expected auto, f32 or fp8)")),
        }
    }
}

#[derive(Clone, Copy, Debug)]
pub struct PoolShape {
    pub num_layers: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
}

impl PoolShape {
    pub fn width(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Bytes one block takes (keys + values, all layers, scales included).
    pub fn block_bytes(&self, dtype: KvDtype) -> usize {
        let per_token = match dtype {
            KvDtype::F32 => self.width() * 4,
            KvDtype::Fp8E4m3 => self.width() + self.num_kv_heads * 4,
        };
        2 * self.num_layers * self.block_size * per_token
    }
}

/// Storage for one of K or V: `[layer][block][slot][width]`.
enum Store {
    F32(Vec<f32>),
    Fp8 { codes: Vec<u8>, scales: Vec<f32> },
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
    keys: Store,
    values: Store,
    refcount: Vec<u32>,
    free: Vec<BlockId>,
    /// Cached blocks nobody references, least recently used first.
    evictable: VecDeque<BlockId>,
    cached: HashMap<BlockHash, BlockId>,
    hash_of: Vec<Option<BlockHash>>,
    pub cache_queries: u64,
    pub cache_hits: u64,
}

impl BlockPool {
    pub fn new(shape: PoolShape, num_blocks: usize, dtype: KvDtype) -> Self {
        let n = shape.num_layers * num_blocks * shape.block_size;
        let mk = || match dtype {
            KvDtype::F32 => Store::F32(vec![0.0; n * shape.width()]),
            KvDtype::Fp8E4m3 => Store::Fp8 { codes: vec![0; n * shape.width()], scales: vec![1.0; n * shape.num_kv_heads] },
        };
        Self {
            shape,
            num_blocks,
            keys: mk(),
            values: mk(),
            refcount: vec![0; num_blocks],
            free: (0..num_blocks as BlockId).rev().collect(),
            evictable: VecDeque::new(),
            cached: HashMap::new(),
            hash_of: vec![None; num_blocks],
            cache_queries: 0,
            cache_hits: 0,
        }
    }

    pub fn shape(&self) -> PoolShape {
        self.shape
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

    fn index(&self, layer: usize, block: BlockId, slot: usize) -> usize {
        (layer * self.num_blocks + block as usize) * self.shape.block_size + slot
    }

    pub fn write(&mut self, layer: usize, block: BlockId, slot: usize, k: &[f32], v: &[f32]) {
        let i = self.index(layer, block, slot);
        let (w, heads, hd) = (self.shape.width(), self.shape.num_kv_heads, self.shape.head_dim);
        for (store, x) in [(&mut self.keys, k), (&mut self.values, v)] {
            match store {
                Store::F32(d) => d[i * w..(i + 1) * w].copy_from_slice(x),
                Store::Fp8 { codes, scales } => {
                    for h in 0..heads {
                        let r = i * w + h * hd..i * w + (h + 1) * hd;
                        scales[i * heads + h] = quantize_e4m3(&x[h * hd..(h + 1) * hd], &mut codes[r]);
                    }
                }
            }
        }
    }

    fn row<'a>(&'a self, store: &'a Store, layer: usize, block: BlockId, slot: usize) -> KvRow<'a> {
        let i = self.index(layer, block, slot);
        let (w, heads) = (self.shape.width(), self.shape.num_kv_heads);
        match store {
            Store::F32(d) => KvRow::F32(&d[i * w..(i + 1) * w]),
            Store::Fp8 { codes, scales } => KvRow::Fp8 { codes: &codes[i * w..(i + 1) * w], scales: &scales[i * heads..(i + 1) * heads] },
        }
    }

    pub fn key(&self, layer: usize, block: BlockId, slot: usize) -> KvRow<'_> {
        self.row(&self.keys, layer, block, slot)
    }

    pub fn value(&self, layer: usize, block: BlockId, slot: usize) -> KvRow<'_> {
        self.row(&self.values, layer, block, slot)
    }

    /// Copies the first `slots` positions of every layer of `src` into `dst` (copy-on-write).
    pub fn copy_block(&mut self, src: BlockId, dst: BlockId, slots: usize) {
        let (w, heads) = (self.shape.width(), self.shape.num_kv_heads);
        for layer in 0..self.shape.num_layers {
            let (s, d) = (self.index(layer, src, 0), self.index(layer, dst, 0));
            for store in [&mut self.keys, &mut self.values] {
                match store {
                    Store::F32(x) => x.copy_within(s * w..(s + slots) * w, d * w),
                    Store::Fp8 { codes, scales } => {
                        codes.copy_within(s * w..(s + slots) * w, d * w);
                        scales.copy_within(s * heads..(s + slots) * heads, d * heads);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(n: usize) -> BlockPool {
        BlockPool::new(PoolShape { num_layers: 2, num_kv_heads: 1, head_dim: 4, block_size: 2 }, n, KvDtype::F32)
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
}
