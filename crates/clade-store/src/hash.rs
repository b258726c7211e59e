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

/// The ids of full 4 KiB `blocks` (concatenated), appended to `out`.
fn hash_full_blocks(blocks: &[u8], out: &mut Vec<ObjectId>) {
    let n = blocks.len() / BLOCK;
    let p = platform();
    let mut cvs = vec![0u8; n * 4 * 32];
    for k in 0..4 {
        let chunks: Vec<&[u8; CHUNK]> =
            (0..n).filter_map(|i| blocks[i * BLOCK + k * CHUNK..i * BLOCK + (k + 1) * CHUNK].try_into().ok()).collect();
        let mut o = vec![0u8; n * 32];
        p.hash_many(&chunks, &IV, k as u64, IncrementCounter::No, 0, CHUNK_START, CHUNK_END, &mut o);
        for i in 0..n {
            cvs[(i * 4 + k) * 32..(i * 4 + k + 1) * 32].copy_from_slice(&o[i * 32..(i + 1) * 32]);
        }
    }
    // Parents of (chunk0, chunk1) and (chunk2, chunk3): consecutive 64-byte pairs of cvs.
    let pairs: Vec<&[u8; 64]> = cvs.chunks_exact(64).filter_map(|c| c.try_into().ok()).collect();
    let mut parents = vec![0u8; n * 2 * 32];
    p.hash_many(&pairs, &IV, 0, IncrementCounter::No, PARENT, 0, 0, &mut parents);
    let roots_in: Vec<&[u8; 64]> = parents.chunks_exact(64).filter_map(|c| c.try_into().ok()).collect();
    let mut roots = vec![0u8; n * 32];
    p.hash_many(&roots_in, &IV, 0, IncrementCounter::No, PARENT | ROOT, 0, 0, &mut roots);
    out.extend(roots.chunks_exact(32).map(|r| {
        let mut id = [0u8; 32];
        id.copy_from_slice(r);
        ObjectId(id)
    }));
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
        }
    }
}
