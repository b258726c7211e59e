//! moto's S3 server (from the setup's Python venv) on loopback with one bucket: a mock kept for unit tests
//! of the S3 code; figures and tests of several hosts use [`super::Garage`].

use std::io::{Read, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::BlobConfig;

/// A running `moto_server` with one bucket.
pub struct Moto {
    child: Child,
    pub port: u16,
    pub bucket: String,
}

impl Moto {
    /// Start `moto_server` (at `bin`) on a free loopback port and create `bucket`.
    pub fn start(bin: &Path, bucket: &str) -> std::io::Result<Moto> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let child = Command::new(bin)
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        let m = Moto { child, port, bucket: bucket.to_string() };
        let start = Instant::now();
        loop {
            if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) {
                let req = format!(
                    "PUT /{bucket} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                );
                s.write_all(req.as_bytes())?;
                let mut out = String::new();
                let _ = s.read_to_string(&mut out);
                if !out.starts_with("HTTP/1.1 200") {
                    return Err(std::io::Error::other(format!("moto: create bucket {bucket}: {out}")));
                }
                return Ok(m);
            }
            if start.elapsed() > Duration::from_secs(30) {
                return Err(std::io::Error::other("moto_server did not listen within 30 s"));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The environment naming this bucket as a clade home's blob tier (`CLADE_BLOB` and friends).
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("CLADE_BLOB", format!("s3://{}", self.bucket)),
            ("CLADE_BLOB_ENDPOINT", format!("http://127.0.0.1:{}", self.port)),
            ("AWS_ACCESS_KEY_ID", "test".into()),
            ("AWS_SECRET_ACCESS_KEY", "test".into()),
        ]
    }

    /// The same as a [`BlobConfig`].
    pub fn config(&self) -> BlobConfig {
        BlobConfig::S3 {
            bucket: self.bucket.clone(),
            endpoint: Some(format!("http://127.0.0.1:{}", self.port)),
            region: "us-east-1".into(),
            access_key_id: "test".into(),
            secret_access_key: "test".into(),
            allow_http: true,
        }
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
