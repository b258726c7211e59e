//! The blob tier: the same layout as the local tier (`packs/ab/<id>.pack|.idx`, `manifests/ab/<id>`,
//! `trees/ab/<id>`) in an `object_store` backend: a local directory (a shared mount, or tests) or an
//! S3-compatible bucket for fleets.
//!
//! `object_store` is async; the store's API is sync (callers are worker threads). So the blob tier owns a small
//! private tokio runtime and blocks on it. A call made inside somebody else's runtime (a vm disk's NBD export
//! reading a frame only the tier holds) cannot enter this one there, so it waits on a plain thread of its own
//! ([`Blob::block_on`]); the caller's task is blocked for the round trip. Async code should still prefer
//! `spawn_blocking`.

use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use object_store::path::Path as BlobPath;
use object_store::{ObjectStore, PutPayload};

use crate::StoreError;

/// Where the blob tier lives.
#[derive(Clone, Debug)]
pub enum BlobConfig {
    /// A directory through `object_store`'s LocalFileSystem.
    Local {
        /// Root directory (created if missing).
        root: PathBuf,
    },
    /// An S3-compatible bucket.
    S3 {
        /// Bucket name (must exist).
        bucket: String,
        /// Endpoint URL, e.g. `http://127.0.0.1:9000`; `None` for AWS itself.
        endpoint: Option<String>,
        /// Region (any string for most S3-compatible servers).
        region: String,
        /// Access key id.
        access_key_id: String,
        /// Secret access key.
        secret_access_key: String,
        /// Allow plain `http://` endpoints.
        allow_http: bool,
    },
}

pub(crate) struct Blob {
    rt: tokio::runtime::Runtime,
    store: Arc<dyn ObjectStore>,
    desc: String,
    /// `desc` and the endpoint, for errors.
    at: String,
}

fn berr(at: &str, op: &'static str, key: &str, e: impl std::fmt::Display) -> StoreError {
    StoreError::Blob { tier: at.to_string(), op, key: key.to_string(), detail: e.to_string() }
}

/// How long a request to the blob tier is retried before its error is returned: `CLADE_BLOB_RETRY_S`, else
/// 20 s (object_store's default of 3 minutes would leave a push to an unreachable tier hanging that long).
fn retry_config() -> object_store::RetryConfig {
    let secs = std::env::var("CLADE_BLOB_RETRY_S").ok().and_then(|v| v.parse::<u64>().ok()).unwrap_or(20);
    object_store::RetryConfig {
        max_retries: 5,
        retry_timeout: Duration::from_secs(secs.clamp(1, 300)),
        ..Default::default()
    }
}

/// How many uploads run at once: `CLADE_BLOB_CONCURRENCY`, else 8 (a pack is up to 32 MiB, so at most
/// ~256 MiB in flight; one stream at a time left a push at a third of a multipart peer's throughput).
pub(crate) fn upload_concurrency() -> usize {
    std::env::var("CLADE_BLOB_CONCURRENCY").ok().and_then(|v| v.parse::<usize>().ok()).unwrap_or(8).clamp(1, 64)
}

/// How many reads run at once: `CLADE_BLOB_FETCH_CONCURRENCY`, else 32. A read is a pack index or one frame
/// (at most 1 MiB), and what a resuming host waits on is each GET's round trip through the store's quorum, not
/// bandwidth: a ct resume from a 3-node Garage on 2 cores took 1.47 s with 8 reads in flight and 1.04 s with 32
/// (docs/roam.md).
pub(crate) fn fetch_concurrency() -> usize {
    std::env::var("CLADE_BLOB_FETCH_CONCURRENCY").ok().and_then(|v| v.parse::<usize>().ok()).unwrap_or(32).clamp(1, 128)
}

/// How many GETs at least a set of ranges is spread over when their asks are joined ([`Blob::get_ranges`]).
const SPREAD: u64 = 8;

impl Blob {
    pub fn open(cfg: &BlobConfig) -> Result<Self, StoreError> {
        let (store, desc, at): (Arc<dyn ObjectStore>, String, String) = match cfg {
            BlobConfig::Local { root } => {
                let at = format!("file://{}", root.display());
                std::fs::create_dir_all(root).map_err(|e| StoreError::io("create blob directory", root, e))?;
                let fs = object_store::local::LocalFileSystem::new_with_prefix(root)
                    .map_err(|e| berr(&at, "open", &root.display().to_string(), e))?;
                (Arc::new(fs), at.clone(), at)
            }
            BlobConfig::S3 { bucket, endpoint, region, access_key_id, secret_access_key, allow_http } => {
                let at = format!("s3://{bucket} at {}", endpoint.as_deref().unwrap_or("AWS"));
                let client = object_store::ClientOptions::new()
                    .with_allow_http(*allow_http)
                    .with_connect_timeout(Duration::from_secs(5))
                    .with_timeout(Duration::from_secs(120));
                let mut b = object_store::aws::AmazonS3Builder::new()
                    .with_client_options(client)
                    .with_retry(retry_config())
                    .with_bucket_name(bucket)
                    .with_region(region)
                    .with_access_key_id(access_key_id)
                    .with_secret_access_key(secret_access_key)
                    .with_allow_http(*allow_http);
                if let Some(ep) = endpoint {
                    b = b.with_endpoint(ep);
                }
                let s3 = b.build().map_err(|e| berr(&at, "open", bucket, e))?;
                (Arc::new(s3), format!("s3://{bucket}"), at)
            }
        };
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("clade-store-blob")
            .enable_all()
            .build()
            .map_err(|e| berr(&at, "start runtime", "", e))?;
        Ok(Blob { rt, store, desc, at })
    }

    pub fn describe(&self) -> &str {
        &self.desc
    }

    fn block_on<F>(&self, key: &str, f: F) -> Result<F::Output, StoreError>
    where
        F: std::future::Future + Send,
        F::Output: Send,
    {
        if tokio::runtime::Handle::try_current().is_ok() {
            // Called from inside another runtime (a vm disk's NBD export reading a frame only the tier holds,
            // for a sandbox that roamed here): this runtime cannot be entered from there, so the call waits on
            // a plain thread of its own. The caller's worker blocks for the round trip, as any reader would.
            return std::thread::scope(|s| s.spawn(|| self.rt.block_on(f)).join())
                .map_err(|_| berr(&self.at, "call", key, "the thread waiting on the blob tier panicked"));
        }
        Ok(self.rt.block_on(f))
    }

    pub fn put(&self, key: &str, data: Vec<u8>) -> Result<(), StoreError> {
        let p = BlobPath::from(key);
        self.block_on(key, self.store.put(&p, PutPayload::from(data)))?.map_err(|e| berr(&self.at, "put", key, e))?;
        Ok(())
    }

    /// Run `requests` on the blob runtime, up to `n` at once; their answers in the order asked, or the first
    /// error (requests still in flight are dropped).
    fn run_many<T: Send, F: std::future::Future<Output = Result<T, StoreError>> + Send>(
        &self,
        what: &str,
        requests: impl Iterator<Item = F> + Send,
        n: usize,
    ) -> Result<Vec<T>, StoreError> {
        use futures::TryStreamExt;
        self.block_on(what, futures::stream::iter(requests).buffered(n).try_collect())?
    }

    /// Upload groups of local files, up to [`upload_concurrency`] groups at once; the files of one group go in
    /// order (a pack, then its index). The caller knows the tier lacks them ([`Blob::has_many`]). Answers the
    /// bytes sent per group. The first error is returned; uploads still in flight are dropped.
    pub fn upload_groups(&self, groups: &[Vec<(String, PathBuf)>]) -> Result<Vec<u64>, StoreError> {
        let what = groups.first().and_then(|g| g.last()).map(|(k, _)| k.as_str()).unwrap_or("");
        self.run_many(what, groups.iter().map(|g| self.upload_group(g)), upload_concurrency())
    }

    async fn upload_group(&self, g: &[(String, PathBuf)]) -> Result<u64, StoreError> {
        let mut sent = 0;
        for (key, path) in g {
            let data = tokio::fs::read(path).await.map_err(|e| {
                StoreError::io("read for the blob tier (it is neither there nor complete locally)", path, e)
            })?;
            sent += data.len() as u64;
            self.store
                .put(&BlobPath::from(key.as_str()), PutPayload::from(data))
                .await
                .map_err(|e| berr(&self.at, "put", key, e))?;
        }
        Ok(sent)
    }

    /// The whole object, or `None` if it does not exist.
    pub fn get(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let r = self.block_on(key, self.get_one(key))??;
        if let Some(b) = &r {
            crate::push::count_fetch(b.len());
        }
        Ok(r)
    }

    async fn get_one(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        match self.store.get(&BlobPath::from(key)).await {
            Ok(g) => g.bytes().await.map(|b| Some(b.to_vec())),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(e),
        }
        .map_err(|e| berr(&self.at, "get", key, e))
    }

    async fn has(&self, key: &str) -> Result<bool, StoreError> {
        match self.store.head(&BlobPath::from(key)).await {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(berr(&self.at, "head", key, e)),
        }
    }

    /// Whether the tier holds each of `keys`, up to four times [`upload_concurrency`] requests at once (a HEAD
    /// carries no data: a push of a mark whose base is up asks about every pack of the base).
    pub fn has_many(&self, keys: &[String]) -> Result<Vec<bool>, StoreError> {
        let what = keys.first().map(String::as_str).unwrap_or("");
        self.run_many(what, keys.iter().map(|k| self.has(k)), 4 * upload_concurrency())
    }

    /// Several whole objects, up to [`fetch_concurrency`] requests at once, in the order asked (`None`:
    /// absent).
    pub fn get_many(&self, keys: &[String]) -> Result<Vec<Option<Vec<u8>>>, StoreError> {
        let what = keys.first().map(String::as_str).unwrap_or("");
        let got = self.run_many(what, keys.iter().map(|k| self.get_one(k)), fetch_concurrency())?;
        for b in got.iter().flatten() {
            crate::push::count_fetch(b.len());
        }
        Ok(got)
    }

    async fn range_one(&self, key: &str, range: Range<u64>) -> Result<Vec<u8>, StoreError> {
        let b =
            self.store.get_range(&BlobPath::from(key), range).await.map_err(|e| berr(&self.at, "get range", key, e))?;
        crate::push::count_fetch(b.len());
        Ok(b.to_vec())
    }

    /// Several byte ranges, up to [`fetch_concurrency`] requests at once, in the order asked. Ranges of one key
    /// that follow each other are asked as one, up to `CLADE_BLOB_COALESCE_BYTES` (default 16 MiB; 0: never): a
    /// GET's round trip through the store's quorum is what a resuming host waits on, and a mark's frames lie one
    /// after another in its packs (a ct resume from Garage on 2 cores: ~0.5 s asking frame by frame, ~0.4 s with
    /// 16 MiB asks; docs/roam.md). Yet one GET is one stream, which a cluster serves block after block: the
    /// asks are kept small enough that there are at least [`SPREAD`] of them (none smaller than 2 MiB), so
    /// that 8 MiB of one pack come as four parallel 2 MiB GETs (~50 ms) rather than one (~150 ms).
    pub fn get_ranges(&self, reqs: &[(String, Range<u64>)]) -> Result<Vec<Vec<u8>>, StoreError> {
        let what = reqs.first().map(|r| r.0.as_str()).unwrap_or("");
        let total: u64 = reqs.iter().map(|(_, r)| r.end.saturating_sub(r.start)).sum();
        let max = std::env::var("CLADE_BLOB_COALESCE_BYTES")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(16 << 20)
            .min((total / SPREAD).max(2 << 20));
        let mut order: Vec<usize> = (0..reqs.len()).collect();
        order.sort_by(|&a, &b| (reqs[a].0.as_str(), reqs[a].1.start).cmp(&(reqs[b].0.as_str(), reqs[b].1.start)));
        // (key, the range asked, the requests it answers)
        let mut groups: Vec<(&str, Range<u64>, Vec<usize>)> = Vec::new();
        for i in order {
            let (k, r) = (&reqs[i].0, &reqs[i].1);
            match groups.last_mut() {
                Some((gk, gr, members)) if *gk == k.as_str() && gr.end == r.start && r.end - gr.start <= max => {
                    gr.end = r.end;
                    members.push(i);
                }
                _ => groups.push((k.as_str(), r.clone(), vec![i])),
            }
        }
        let got =
            self.run_many(what, groups.iter().map(|(k, r, _)| self.range_one(k, r.clone())), fetch_concurrency())?;
        let mut out = vec![Vec::new(); reqs.len()];
        for ((k, gr, members), bytes) in groups.iter().zip(got) {
            for &i in members {
                let r = &reqs[i].1;
                let part = bytes.get((r.start - gr.start) as usize..(r.end - gr.start) as usize).ok_or_else(|| {
                    StoreError::Blob {
                        tier: self.at.clone(),
                        op: "get range",
                        key: k.to_string(),
                        detail: format!(
                            "asked for bytes {}..{}, got {}: the object is shorter than its index says",
                            gr.start,
                            gr.end,
                            bytes.len()
                        ),
                    }
                })?;
                out[i] = part.to_vec();
            }
        }
        Ok(out)
    }

    pub fn get_range(&self, key: &str, range: Range<u64>) -> Result<Vec<u8>, StoreError> {
        self.block_on(key, self.range_one(key, range))?
    }

    /// Keys under `prefix`.
    pub fn list(&self, prefix: &str) -> Result<Vec<String>, StoreError> {
        let p = BlobPath::from(prefix);
        let r = self.block_on(prefix, async {
            let mut out = Vec::new();
            let mut s = self.store.list(Some(&p));
            while let Some(m) = s.next().await {
                out.push(m?.location.to_string());
            }
            Ok::<_, object_store::Error>(out)
        })?;
        r.map_err(|e| berr(&self.at, "list", prefix, e))
    }

    /// Keys under `prefix` with their size and age (for gc's grace period).
    pub fn list_meta(&self, prefix: &str) -> Result<Vec<BlobMeta>, StoreError> {
        let p = BlobPath::from(prefix);
        let r = self.block_on(prefix, async {
            let mut out = Vec::new();
            let mut s = self.store.list(Some(&p));
            while let Some(m) = s.next().await {
                let m = m?;
                let age = (now_millis() - m.last_modified.timestamp_millis()).max(0) as u64;
                out.push(BlobMeta { key: m.location.to_string(), size: m.size, age: Duration::from_millis(age) });
            }
            Ok::<_, object_store::Error>(out)
        })?;
        r.map_err(|e| berr(&self.at, "list", prefix, e))
    }

    /// Delete a key (a missing key is not an error).
    pub fn delete(&self, key: &str) -> Result<(), StoreError> {
        let p = BlobPath::from(key);
        match self.block_on(key, self.store.delete(&p))? {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(berr(&self.at, "delete", key, e)),
        }
    }
}

/// A key of the blob tier, its size and how long ago it was last written.
#[derive(Clone, Debug)]
pub(crate) struct BlobMeta {
    pub key: String,
    pub size: u64,
    pub age: Duration,
}

/// Milliseconds since the epoch, now.
pub(crate) fn now_millis() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Ranges asked out of order, some following each other (asked as one GET), some not, over two keys: each
    /// answer is its own range's bytes, in the order asked.
    #[test]
    fn ranges_that_follow_each_other_are_fetched_together_and_split_back() {
        let d = tempfile::tempdir().unwrap();
        let blob = Blob::open(&BlobConfig::Local { root: d.path().to_path_buf() }).unwrap();
        let k1: Vec<u8> = (0..1000u32).map(|i| (i % 251) as u8).collect();
        let k2: Vec<u8> = (0..100u32).map(|i| (i * 7 % 256) as u8).collect();
        blob.put("packs/k1", k1.clone()).unwrap();
        blob.put("packs/k2", k2.clone()).unwrap();
        let asks: Vec<(String, Range<u64>)> = [
            ("packs/k1", 100..200),
            ("packs/k2", 0..10),
            ("packs/k1", 0..100),
            ("packs/k1", 200..300),
            ("packs/k1", 150..160),
            ("packs/k2", 10..100),
            ("packs/k1", 500..1000),
        ]
        .into_iter()
        .map(|(k, r)| (k.to_string(), r))
        .collect();
        let got = blob.get_ranges(&asks).unwrap();
        for ((k, r), bytes) in asks.iter().zip(&got) {
            let whole = if k.ends_with("k1") { &k1 } else { &k2 };
            assert_eq!(bytes.as_slice(), &whole[r.start as usize..r.end as usize], "{k} {r:?}");
        }
    }
}
