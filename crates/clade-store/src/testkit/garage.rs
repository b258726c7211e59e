//! A real, distributed S3 server for tests and benches: a Garage cluster of three nodes on loopback with
//! replication factor 3 (every object on every node; a write or read needs a quorum of two), one bucket and
//! one key allowed on it. Nodes can be stopped (SIGKILL) and started again to test a store node going down.
//! Everything lives in a directory under `/var/tmp`, removed with the cluster on drop.
//!
//! Clients talk to node 0's S3 endpoint, as a host would talk to its nearest Garage node; node 0 forwards
//! every request to the quorum, so stopping node 1 or 2 leaves the bucket fully usable.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rand::Rng;

use crate::BlobConfig;

/// One Garage node: its ports, its directory and (while it runs) its process.
pub struct GarageNode {
    /// Its S3 API port on 127.0.0.1.
    pub s3_port: u16,
    rpc_port: u16,
    dir: PathBuf,
    child: Option<Child>,
    /// `<public key hex>@127.0.0.1:<rpc port>`, once it has started.
    pub id: String,
}

impl GarageNode {
    fn config(&self) -> PathBuf {
        self.dir.join("garage.toml")
    }
}

/// A running Garage cluster with one bucket and a key allowed on it.
pub struct Garage {
    bin: PathBuf,
    dir: PathBuf,
    /// The nodes; node 0 serves the S3 endpoint clients use.
    pub nodes: Vec<GarageNode>,
    /// The bucket.
    pub bucket: String,
    /// The key allowed to read and write it.
    pub key_id: String,
    /// Its secret.
    pub secret: String,
}

fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn hex(bytes: usize) -> String {
    let mut b = vec![0u8; bytes];
    rand::rng().fill(&mut b[..]);
    ::hex::encode(b)
}

fn err(what: impl std::fmt::Display) -> std::io::Error {
    std::io::Error::other(format!("garage: {what}"))
}

impl Garage {
    /// Start a cluster of three nodes (Garage at `bin`), replication factor 3, and create `bucket`.
    pub fn start(bin: &Path, bucket: &str) -> std::io::Result<Garage> {
        Self::start_nodes(bin, bucket, 3)
    }

    /// Start a cluster of `n` nodes (1 to 3; the replication factor is `n`) and create `bucket`.
    pub fn start_nodes(bin: &Path, bucket: &str, n: usize) -> std::io::Result<Garage> {
        if !(1..=3).contains(&n) {
            return Err(err(format!("a test cluster has 1 to 3 nodes, not {n}")));
        }
        let dir = PathBuf::from(format!("/var/tmp/clade-garage-{}-{}", std::process::id(), hex(4)));
        std::fs::create_dir_all(&dir)?;
        let mut g = Garage {
            bin: bin.to_path_buf(),
            dir,
            nodes: Vec::new(),
            bucket: bucket.to_string(),
            key_id: format!("GK{}", hex(12)),
            secret: hex(32),
        };
        let rpc_secret = hex(32);
        for i in 0..n {
            let node = GarageNode {
                s3_port: free_port()?,
                rpc_port: free_port()?,
                dir: g.dir.join(format!("node{i}")),
                child: None,
                id: String::new(),
            };
            std::fs::create_dir_all(&node.dir)?;
            let conf = format!(
                r#"metadata_dir = "{d}/meta"
data_dir = "{d}/data"
db_engine = "sqlite"
metadata_fsync = false
data_fsync = false
replication_factor = {n}
rpc_bind_addr = "127.0.0.1:{rpc}"
rpc_public_addr = "127.0.0.1:{rpc}"
rpc_secret = "{rpc_secret}"

[s3_api]
s3_region = "us-east-1"
api_bind_addr = "127.0.0.1:{s3}"
root_domain = ".s3.garage.localhost"
"#,
                d = node.dir.display(),
                rpc = node.rpc_port,
                s3 = node.s3_port,
            );
            std::fs::write(node.config(), conf)?;
            g.nodes.push(node);
        }
        for i in 0..n {
            g.start_node(i)?;
        }
        for i in 1..n {
            // A node that answers its status may not take peers' RPCs yet ("No handler"): connect again.
            let id = g.nodes[i].id.clone();
            g.retry(|g| g.cli(0, &["node", "connect", &id]).map(drop))?;
        }
        for i in 0..n {
            let short = g.nodes[i].id.split('@').next().unwrap_or_default().to_string();
            g.cli(0, &["layout", "assign", "-z", &format!("dc{i}"), "-c", "1G", &short])?;
        }
        g.cli(0, &["layout", "apply", "--version", "1"])?;
        let (key_id, secret, bucket) = (g.key_id.clone(), g.secret.clone(), g.bucket.clone());
        g.retry(|g| g.cli(0, &["key", "import", "--yes", "-n", "clade", &key_id, &secret]).map(drop))?;
        g.retry(|g| g.cli(0, &["bucket", "create", &bucket]).map(drop))?;
        g.cli(0, &["bucket", "allow", "--read", "--write", "--owner", &bucket, "--key", &key_id])?;
        // The bucket answers S3 once the layout and the key have reached the quorum.
        let blob = crate::blob::Blob::open(&g.config()).map_err(err)?;
        g.retry(|_| blob.put("clade-ready", b"ok".to_vec()).map_err(err))?;
        blob.delete("clade-ready").map_err(err)?;
        Ok(g)
    }

    /// Run `garage` against node `i`'s configuration; its stdout, or an error with its stderr.
    pub fn cli(&self, i: usize, args: &[&str]) -> std::io::Result<String> {
        let out = Command::new(&self.bin).arg("-c").arg(self.nodes[i].config()).args(args).output()?;
        if !out.status.success() {
            return Err(err(format!("garage {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim())));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Try `f` for up to 30 s (the cluster settles after layout changes and restarts).
    fn retry(&self, mut f: impl FnMut(&Self) -> std::io::Result<()>) -> std::io::Result<()> {
        let start = Instant::now();
        loop {
            match f(self) {
                Ok(()) => return Ok(()),
                Err(e) if start.elapsed() > Duration::from_secs(30) => return Err(e),
                Err(_) => std::thread::sleep(Duration::from_millis(200)),
            }
        }
    }

    /// Start node `i` (again, after [`Garage::stop_node`]: its data is kept) and wait until it answers.
    pub fn start_node(&mut self, i: usize) -> std::io::Result<()> {
        let node = &mut self.nodes[i];
        if node.child.is_some() {
            return Ok(());
        }
        let log = std::fs::OpenOptions::new().create(true).append(true).open(node.dir.join("garage.log"))?;
        let child = Command::new(&self.bin)
            .arg("-c")
            .arg(node.config())
            .arg("server")
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        node.child = Some(child);
        let mut id = String::new();
        self.retry(|g| {
            id = g.cli(i, &["node", "id", "-q"])?.trim().to_string();
            Ok(())
        })?;
        self.nodes[i].id = id;
        Ok(())
    }

    /// Kill node `i` (SIGKILL, as a crashed store node); its data stays for [`Garage::start_node`].
    pub fn stop_node(&mut self, i: usize) {
        if let Some(mut c) = self.nodes[i].child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// The S3 endpoint clients use (node 0).
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.nodes[0].s3_port)
    }

    /// The environment naming this bucket as a clade home's blob tier (`CLADE_BLOB` and friends).
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("CLADE_BLOB", format!("s3://{}", self.bucket)),
            ("CLADE_BLOB_ENDPOINT", self.endpoint()),
            ("AWS_ACCESS_KEY_ID", self.key_id.clone()),
            ("AWS_SECRET_ACCESS_KEY", self.secret.clone()),
        ]
    }

    /// The same as a [`BlobConfig`].
    pub fn config(&self) -> BlobConfig {
        BlobConfig::S3 {
            bucket: self.bucket.clone(),
            endpoint: Some(self.endpoint()),
            region: "us-east-1".into(),
            access_key_id: self.key_id.clone(),
            secret_access_key: self.secret.clone(),
            allow_http: true,
        }
    }
}

impl Drop for Garage {
    fn drop(&mut self) {
        for i in 0..self.nodes.len() {
            self.stop_node(i);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
