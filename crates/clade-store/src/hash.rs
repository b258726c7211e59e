//! BLAKE3 of many 4 KiB blocks at once, at the full SIMD width of the machine.
//!
//! `blake3::hash` of one 4 KiB block fills only 4 of AVX-512's 16 lanes (a block is 4 chunks), so hashing a
//! GiB block by block costs about 3x what hashing it as one input does. Here the k-th chunk of every block
//! in a batch is compressed in one `hash_many` call (16 lanes), then the two parent levels likewise: the same
//! BLAKE3 tree, the same hashes as `blake3::hash(block)` (tested below against it), at bulk speed.
//! `platform::hash_many` is blake3's hidden, unstable API, so the dependency is pinned to an exact version.

use blake3::platform::Platform;
use blake3::IncrementCounter;

use crate::ids::ObjectId;
use crate::BLOCK;

const CHUNK: usize = 1024;
const IV: [u32; 8] = [0x6A09E667, 0xBB67AE85, 0x3C6EF372, 0xA54FF53A, 0x510E527F, 0x9B05688C, 0x1F83D9AB, 0x5BE0CD19];
const CHUNK_START: u8 = 1;
const CHUNK_END: u8 = 2;
const PARENT: u8 = 4;
const ROOT: u8 = 8;

fn platform() -> Platform {
    static P: std::sync::OnceLock<Platform> = std::sync::OnceLock::new();
    *P.get_or_init(Platform::detect)
}

/// Blocks hashed per `hash_many` call: the widest SIMD batch (AVX-512: 16 lanes).
const LANES: usize = 16;

/// The ids of full 4 KiB `blocks` (concatenated), appended to `out`. No heap allocation: groups of 16
/// blocks, each level of the tree one `hash_many` call on stack buffers.
fn hash_full_blocks(blocks: &[u8], out: &mut Vec<ObjectId>) {
    static NO_CHUNK: [u8; CHUNK] = [0u8; CHUNK];
    static NO_PAIR: [u8; 64] = [0u8; 64];
    let p = platform();
    for group in blocks.chunks(LANES * BLOCK) {
        let n = group.len() / BLOCK;
        // Chaining values of every chunk: block i, chunk k at (i * 4 + k) * 32.
        let mut cvs = [0u8; LANES * 4 * 32];
        let mut o = [0u8; LANES * 32];
        for k in 0..4 {
            let mut chunks: [&[u8; CHUNK]; LANES] = [&NO_CHUNK; LANES];
            for (i, c) in chunks.iter_mut().enumerate().take(n) {
                if let Ok(r) = group[i * BLOCK + k * CHUNK..i * BLOCK + (k + 1) * CHUNK].try_into() {
                    *c = r;
                }
            }
            p.hash_many(&chunks[..n], &IV, k as u64, IncrementCounter::No, 0, CHUNK_START, CHUNK_END, &mut o[..n * 32]);
            for i in 0..n {
                cvs[(i * 4 + k) * 32..(i * 4 + k + 1) * 32].copy_from_slice(&o[i * 32..(i + 1) * 32]);
            }
        }
        // Parents of (chunk0, chunk1) and (chunk2, chunk3): consecutive 64-byte pairs of cvs.
        let mut pairs: [&[u8; 64]; 2 * LANES] = [&NO_PAIR; 2 * LANES];
        for (d, c) in pairs.iter_mut().zip(cvs[..n * 128].chunks_exact(64)) {
            if let Ok(r) = c.try_into() {
                *d = r;
            }
        }
        let mut parents = [0u8; LANES * 2 * 32];
        p.hash_many(&pairs[..2 * n], &IV, 0, IncrementCounter::No, PARENT, 0, 0, &mut parents[..n * 64]);
        let mut tops: [&[u8; 64]; LANES] = [&NO_PAIR; LANES];
        for (d, c) in tops.iter_mut().zip(parents[..n * 64].chunks_exact(64)) {
            if let Ok(r) = c.try_into() {
                *d = r;
            }
        }
        p.hash_many(&tops[..n], &IV, 0, IncrementCounter::No, PARENT | ROOT, 0, 0, &mut o[..n * 32]);
        out.extend(o[..n * 32].chunks_exact(32).map(|r| {
            let mut id = [0u8; 32];
            id.copy_from_slice(r);
            ObjectId(id)
        }));
    }
}

/// The id of every 4 KiB block of `data` (the last may be short), zero blocks included (for verification:
/// stored blocks are never zero, so there is nothing to skip and no reason to scan for zeros first).
pub(crate) fn hash_every_block(data: &[u8]) -> Vec<ObjectId> {
    let full = data.len() / BLOCK * BLOCK;
    let mut out = Vec::with_capacity(data.len().div_ceil(BLOCK));
    hash_full_blocks(&data[..full], &mut out);
    if full < data.len() {
        out.push(ObjectId::of(&data[full..]));
    }
    out
}

/// For each 4 KiB block of `data` (the last may be short): `None` if all zero, else its id.
pub(crate) fn hash_blocks(data: &[u8]) -> Vec<Option<ObjectId>> {
    let zero = [0u8; BLOCK];
    let full = data.len() / BLOCK * BLOCK;
    // Gather the non-zero full blocks, hash them in one batch, scatter back.
    let nonzero: Vec<usize> =
        data[..full].chunks_exact(BLOCK).enumerate().filter(|(_, b)| *b != &zero[..]).map(|(i, _)| i).collect();
    let mut ids = Vec::with_capacity(nonzero.len());
    // Contiguous runs of non-zero blocks are hashed straight from `data`.
    let mut i = 0;
    while i < nonzero.len() {
        let mut j = i + 1;
        while j < nonzero.len() && nonzero[j] == nonzero[j - 1] + 1 {
            j += 1;
        }
        hash_full_blocks(&data[nonzero[i] * BLOCK..(nonzero[j - 1] + 1) * BLOCK], &mut ids);
        i = j;
    }
    let mut out = vec![None; data.len().div_ceil(BLOCK)];
    for (k, id) in nonzero.into_iter().zip(ids) {
        out[k] = Some(id);
    }
    if full < data.len() {
        let tail = &data[full..];
        if tail.iter().any(|b| *b != 0) {
            out[full / BLOCK] = Some(ObjectId::of(tail));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn batch_hashes_equal_blake3_of_each_block() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        for n in [0usize, 1, 2, 15, 16, 17, 100] {
            let mut data = vec![0u8; n * BLOCK + rng.random_range(0..BLOCK)];
            for (i, b) in data.chunks_mut(BLOCK).enumerate() {
                if i % 3 != 1 {
                    rng.fill(b);
                }
            }
            let got = hash_blocks(&data);
            let want: Vec<Option<ObjectId>> = data
                .chunks(BLOCK)
                .map(|b| if b.iter().all(|x| *x == 0) { None } else { Some(ObjectId::of(b)) })
                .collect();
            assert_eq!(got, want, "n={n}");
            let every: Vec<ObjectId> = data.chunks(BLOCK).map(ObjectId::of).collect();
            assert_eq!(hash_every_block(&data), every, "n={n}");
        }
    }
}
