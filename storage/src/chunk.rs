//! One chunk: named by the SHA-256 of its uncompressed bytes, stored zstd-compressed.

use sha2::{Digest, Sha256};

use crate::error::{Result, StorageError};
use crate::manifest::CHUNK_BYTES;

/// The zstd level chunks are compressed at (zstd's default: fast, a fair ratio).
pub const ZSTD_LEVEL: i32 = 3;

/// The lowercase hex SHA-256 of `data`.
pub fn sha256_hex(data: &[u8]) -> String {
    hex::encode(Sha256::digest(data))
}

/// Compresses a chunk for storage.
pub fn encode(data: &[u8]) -> Vec<u8> {
    zstd::bulk::compress(data, ZSTD_LEVEL).expect("compressing a memory buffer does not fail")
}

/// Decompresses a stored chunk and checks that it is the chunk named `hash` of `len` bytes.
/// Decompression stops at [`CHUNK_BYTES`], so a forged chunk cannot inflate without bound.
///
/// Errors: [`StorageError::Corrupt`].
pub fn decode(hash: &str, len: u32, stored: &[u8]) -> Result<Vec<u8>> {
    let corrupt = |reason: String| StorageError::Corrupt {
        hash: hash.to_owned(),
        reason,
    };
    let data = zstd::bulk::decompress(stored, CHUNK_BYTES)
        .map_err(|e| corrupt(format!("does not decompress: {e}")))?;
    if data.len() != len as usize {
        return Err(corrupt(format!(
            "{} bytes, the manifest says {len}",
            data.len()
        )));
    }
    let got = sha256_hex(&data);
    if got != hash {
        return Err(corrupt(format!("its content hashes to {got}")));
    }
    Ok(data)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chunk_decodes_to_itself_and_a_damaged_or_swapped_one_is_refused() {
        let data = b"hello hello hello hello".repeat(100);
        let hash = sha256_hex(&data);
        let stored = encode(&data);
        assert!(stored.len() < data.len());
        assert_eq!(decode(&hash, data.len() as u32, &stored).unwrap(), data);
        let other = encode(b"something else");
        assert!(matches!(
            decode(&hash, 14, &other),
            Err(StorageError::Corrupt { .. })
        ));
        let mut flipped = stored.clone();
        let mid = flipped.len() / 2;
        flipped[mid] ^= 0xff;
        assert!(decode(&hash, data.len() as u32, &flipped).is_err());
        let bomb = encode(&vec![0u8; CHUNK_BYTES + 1]);
        assert!(
            decode(&hash, 1, &bomb).is_err(),
            "more than a chunk is refused"
        );
    }
}
