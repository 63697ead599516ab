//! The host-side chunk cache: compressed chunks by hash in one directory, bounded in bytes,
//! least recently used evicted first. A clone or restore reads what its host already holds and
//! fetches only the rest; a fresh snapshot's chunks enter it once they are durable.
//!
//! Guarantees: a chunk is in the cache only whole (written to a temporary name, then renamed)
//! and only after its hash was checked; the cache never holds more than its bound once an
//! insert returns, except a single chunk larger than the bound, which is not kept at all.
//! Assumptions: one process owns the directory. On open, the files' modification times seed
//! the recency order, so a restarted hostd keeps its cache.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use bytes::Bytes;
use lru::LruCache;

use crate::error::{Result, StorageError};

/// The default bound of a host's chunk cache: 10 GiB.
pub const DEFAULT_CACHE_BYTES: u64 = 10 << 30;

/// A bounded directory of compressed chunks.
#[derive(Debug)]
pub struct ChunkCache {
    dir: PathBuf,
    bound: u64,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    lru: LruCache<String, u64>,
    total: u64,
}

impl ChunkCache {
    /// Opens (creating) the cache at `dir`, bounded to `bound` bytes. Leftover temporary files
    /// are removed; if the directory already holds more than the bound, the oldest go.
    ///
    /// Errors: [`StorageError::Io`] when the directory cannot be created or read.
    pub fn open(dir: &Path, bound: u64) -> Result<ChunkCache> {
        fs::create_dir_all(dir).map_err(StorageError::io("create", dir))?;
        let mut found = Vec::new();
        for e in fs::read_dir(dir).map_err(StorageError::io("read", dir))? {
            let e = e.map_err(StorageError::io("read", dir))?;
            let name = e.file_name().to_string_lossy().into_owned();
            let meta = e.metadata().map_err(StorageError::io("stat", e.path()))?;
            match name.strip_suffix(".zst") {
                Some(hash) if meta.is_file() && is_hash(hash) => {
                    found.push((meta.modified().ok(), hash.to_owned(), meta.len()));
                }
                _ => {
                    let _ = fs::remove_file(e.path());
                }
            }
        }
        found.sort();
        let cache = ChunkCache {
            dir: dir.to_owned(),
            bound,
            state: Mutex::new(State {
                lru: LruCache::unbounded(),
                total: 0,
            }),
        };
        {
            let mut s = cache.state.lock().expect("cache lock");
            for (_, hash, len) in found {
                s.total += len;
                s.lru.put(hash, len);
            }
        }
        cache.evict();
        Ok(cache)
    }

    /// The bound in bytes.
    pub fn bound(&self) -> u64 {
        self.bound
    }

    /// Bytes held now.
    pub fn held_bytes(&self) -> u64 {
        self.state.lock().expect("cache lock").total
    }

    /// Whether the chunk is held (does not count as a use).
    pub fn contains(&self, hash: &str) -> bool {
        self.state.lock().expect("cache lock").lru.contains(hash)
    }

    /// The compressed chunk, if held; marks it most recently used. Its hash is checked again
    /// by whoever decompresses it ([`crate::chunk::decode`]).
    pub fn get(&self, hash: &str) -> Option<Bytes> {
        self.state.lock().expect("cache lock").lru.get(hash)?;
        match fs::read(self.path_of(hash)) {
            Ok(b) => Some(Bytes::from(b)),
            Err(_) => {
                // Removed behind our back: forget it.
                let mut s = self.state.lock().expect("cache lock");
                if let Some(len) = s.lru.pop(hash) {
                    s.total -= len;
                }
                None
            }
        }
    }

    /// Stores a compressed chunk whose hash the caller has verified, then evicts down to the
    /// bound. A chunk already held is only marked used.
    ///
    /// Errors: [`StorageError::Io`] writing it.
    pub fn insert(&self, hash: &str, compressed: &[u8]) -> Result<()> {
        let len = compressed.len() as u64;
        if len > self.bound || self.touch(hash) {
            return Ok(());
        }
        // A name of this insert's own: concurrent fetches of one chunk (the same chunk in
        // several snapshots restored at once) wrote and renamed each other's file, and the
        // second rename failed its restore ("rename …: No such file").
        static INSERTS: AtomicU64 = AtomicU64::new(0);
        let tmp = self.dir.join(format!(
            ".{hash}.{}.{}.tmp",
            std::process::id(),
            INSERTS.fetch_add(1, Ordering::Relaxed)
        ));
        fs::write(&tmp, compressed).map_err(StorageError::io("write", &tmp))?;
        self.adopt(hash, &tmp, len)
    }

    /// Moves a compressed chunk file (a snapshot's staged chunk, same filesystem) into the
    /// cache, then evicts down to the bound.
    ///
    /// Errors: [`StorageError::Io`] renaming it.
    pub fn insert_file(&self, hash: &str, file: &Path) -> Result<()> {
        let len = fs::metadata(file)
            .map_err(StorageError::io("stat", file))?
            .len();
        if len > self.bound || self.touch(hash) {
            let _ = fs::remove_file(file);
            return Ok(());
        }
        self.adopt(hash, file, len)
    }

    fn touch(&self, hash: &str) -> bool {
        self.state
            .lock()
            .expect("cache lock")
            .lru
            .get(hash)
            .is_some()
    }

    fn adopt(&self, hash: &str, file: &Path, len: u64) -> Result<()> {
        let dest = self.path_of(hash);
        if let Err(e) = fs::rename(file, &dest) {
            let _ = fs::remove_file(file);
            return Err(StorageError::io("rename", dest)(e));
        }
        {
            let mut s = self.state.lock().expect("cache lock");
            if s.lru.put(hash.to_owned(), len).is_none() {
                s.total += len;
            }
        }
        self.evict();
        Ok(())
    }

    /// Drops every chunk not in `keep` (the chunks some snapshot row still references);
    /// returns the bytes freed.
    pub fn sweep(&self, keep: &dyn Fn(&str) -> bool) -> u64 {
        let gone: Vec<(String, u64)> = {
            let s = self.state.lock().expect("cache lock");
            s.lru
                .iter()
                .filter(|(h, _)| !keep(h))
                .map(|(h, l)| (h.clone(), *l))
                .collect()
        };
        let mut freed = 0;
        for (hash, _) in gone {
            let mut s = self.state.lock().expect("cache lock");
            if let Some(len) = s.lru.pop(&hash) {
                s.total -= len;
                freed += len;
            }
            drop(s);
            let _ = fs::remove_file(self.path_of(&hash));
        }
        freed
    }

    fn evict(&self) {
        loop {
            let victim = {
                let mut s = self.state.lock().expect("cache lock");
                if s.total <= self.bound {
                    return;
                }
                let Some((hash, len)) = s.lru.pop_lru() else {
                    return;
                };
                s.total -= len;
                hash
            };
            let _ = fs::remove_file(self.path_of(&victim));
        }
    }

    fn path_of(&self, hash: &str) -> PathBuf {
        self.dir.join(format!("{hash}.zst"))
    }
}

fn is_hash(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(i: u8) -> String {
        format!("{i:02x}").repeat(32)
    }

    #[test]
    fn one_chunk_inserted_by_many_at_once_is_held_once_and_whole() {
        let dir = tempfile::tempdir().unwrap();
        let cache = ChunkCache::open(dir.path(), 1 << 20).unwrap();
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    for _ in 0..50 {
                        cache.insert(&h(7), &[7; 4096]).unwrap();
                    }
                });
            }
        });
        assert_eq!(cache.get(&h(7)).as_deref(), Some(&[7u8; 4096][..]));
        assert_eq!(cache.held_bytes(), 4096);
        let left: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left.len(), 1, "no temporary file is left: {left:?}");
    }

    #[test]
    fn the_least_recently_used_chunk_goes_first_and_the_bound_holds() {
        let dir = tempfile::tempdir().unwrap();
        let cache = ChunkCache::open(dir.path(), 300).unwrap();
        cache.insert(&h(1), &[1; 100]).unwrap();
        cache.insert(&h(2), &[2; 100]).unwrap();
        cache.insert(&h(3), &[3; 100]).unwrap();
        assert!(cache.get(&h(1)).is_some(), "use 1, so 2 is now the oldest");
        cache.insert(&h(4), &[4; 100]).unwrap();
        assert!(
            cache.contains(&h(1))
                && !cache.contains(&h(2))
                && cache.contains(&h(3))
                && cache.contains(&h(4))
        );
        assert_eq!(cache.held_bytes(), 300);
        assert!(
            !dir.path().join(format!("{}.zst", h(2))).exists(),
            "the evicted file is gone"
        );
        cache.insert(&h(5), &[5; 301]).unwrap();
        assert!(
            !cache.contains(&h(5)),
            "a chunk larger than the bound is not kept"
        );
        assert_eq!(cache.held_bytes(), 300);
    }

    #[test]
    fn a_reopened_cache_keeps_its_chunks_and_drops_leftovers_and_sweeps_the_unreferenced() {
        let dir = tempfile::tempdir().unwrap();
        {
            let cache = ChunkCache::open(dir.path(), 1000).unwrap();
            cache.insert(&h(1), &[1; 10]).unwrap();
            cache.insert(&h(2), &[2; 10]).unwrap();
        }
        fs::write(dir.path().join(".half.tmp"), b"x").unwrap();
        let cache = ChunkCache::open(dir.path(), 1000).unwrap();
        assert_eq!(cache.held_bytes(), 20);
        assert_eq!(cache.get(&h(2)).unwrap().as_ref(), &[2; 10]);
        assert!(!dir.path().join(".half.tmp").exists());
        let keep = h(1);
        assert_eq!(cache.sweep(&|x| x == keep), 10);
        assert!(cache.contains(&h(1)) && !cache.contains(&h(2)));
    }
}
