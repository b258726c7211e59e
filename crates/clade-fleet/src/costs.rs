//! Suspend and resume costs as clade measured them: time samples and bytes, each with the place it came from.
//! Three readers: the `vm` bench's figures (`bench/out/vm.jsonl`), the `ct` bench's lines (`bench/out/ct.jsonl`),
//! and the ledger's operations log (given here as plain [`OpSample`]s, so this crate needs no SQLite).

use std::collections::BTreeMap;

use serde::Serialize;

/// Measured costs of one backend. Times in milliseconds; bytes per operation.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Measured {
    /// `vm (tcg)`, `vm (kvm)`, `ct`.
    pub backend: String,
    /// Time from the user's return to a running sandbox, one sample per measured resume.
    pub resume_ms: Vec<f64>,
    /// Time a suspending sandbox still holds its host, one sample per measured suspend.
    pub suspend_ms: Vec<f64>,
    /// Bytes a suspend writes (the mark's newly stored objects).
    pub suspend_bytes: Option<f64>,
    /// Bytes a resume fetches on a host whose cache lacks the session (`None`: taken as `suspend_bytes`, what the
    /// mark newly stored, with the image's base already cached on every host).
    pub resume_bytes: Option<f64>,
    /// Where each figure came from: key (`resume_ms`, `suspend_ms`, `suspend_bytes`, `resume_bytes`) -> text.
    pub sources: BTreeMap<String, String>,
}

#[derive(Debug, thiserror::Error)]
pub enum CostError {
    #[error("{source_name}: {message}")]
    Incomplete { source_name: String, message: String },
    #[error(
        "no measured suspend/resume costs ({tried}). Measure them first: `./x bench vm --quick` (or `./x bench ct`) \
         writes bench/out/*.jsonl, or run `clade fleet simulate --measure` for a quick ct suspend/resume"
    )]
    NoneFound { tried: String },
}

fn incomplete(source_name: &str, message: impl Into<String>) -> CostError {
    CostError::Incomplete { source_name: source_name.into(), message: message.into() }
}

fn lines(text: &str) -> impl Iterator<Item = serde_json::Value> + '_ {
    text.lines().filter_map(|l| serde_json::from_str::<serde_json::Value>(l.trim()).ok()).filter(|v| v.is_object())
}

fn nums(v: &serde_json::Value) -> Vec<f64> {
    v.as_array().map(|a| a.iter().filter_map(|x| x.as_f64()).filter(|x| x.is_finite()).collect()).unwrap_or_default()
}

/// The `vm` bench's figure names this reader uses (crates/clade-bench/src/vm.rs).
pub const VM_RESUME_FIGURE: &str = "vm retake to an earlier mark, end to end";
pub const VM_SUSPEND_FIGURE: &str = "vm mark pause, 512 MiB guest, ~32 MiB dirtied";

impl Measured {
    /// From `clade-bench vm`'s JSON lines. Resume: the retake figure's samples (the supervisor ends the sandbox and
    /// restores a mark with hygiene: a resume without the supervisor's start). Suspend: the mark pause samples.
    /// Bytes: the stored bytes of that figure's last mark.
    pub fn from_vm_bench(text: &str, source_name: &str) -> Result<Self, CostError> {
        let figs: Vec<serde_json::Value> = lines(text).collect();
        let find = |name: &str| figs.iter().find(|f| f["name"].as_str() == Some(name));
        let resume = find(VM_RESUME_FIGURE)
            .ok_or_else(|| incomplete(source_name, format!("no figure {VM_RESUME_FIGURE:?}; rerun `./x bench vm`")))?;
        let suspend = find(VM_SUSPEND_FIGURE)
            .ok_or_else(|| incomplete(source_name, format!("no figure {VM_SUSPEND_FIGURE:?}; rerun `./x bench vm`")))?;
        let (resume_ms, suspend_ms) = (nums(&resume["samples"]), nums(&suspend["samples"]));
        if resume_ms.is_empty() || suspend_ms.is_empty() {
            return Err(incomplete(
                source_name,
                "the retake or mark-pause figure has no samples; rerun `./x bench vm`",
            ));
        }
        let accel = resume["detail"]["accel"].as_str().unwrap_or("unknown accelerator").to_string();
        let bytes = suspend["detail"]["last"]["mark_stored_bytes"].as_f64();
        let mut sources = BTreeMap::new();
        sources.insert(
            "resume_ms".into(),
            format!("{source_name}: {VM_RESUME_FIGURE:?} ({} samples; kill + restore + hygiene)", resume_ms.len()),
        );
        sources.insert(
            "suspend_ms".into(),
            format!("{source_name}: {VM_SUSPEND_FIGURE:?} ({} samples)", suspend_ms.len()),
        );
        if bytes.is_some() {
            sources.insert(
                "suspend_bytes".into(),
                format!("{source_name}: {VM_SUSPEND_FIGURE:?} detail.last.mark_stored_bytes"),
            );
        }
        Ok(Self {
            backend: format!("vm ({accel})"),
            resume_ms,
            suspend_ms,
            suspend_bytes: bytes,
            resume_bytes: None,
            sources,
        })
    }

    /// From `ct-bench`'s JSON lines. Resume: every `start` line's `restore_hygiene_ms` (a CRIU restore of a mark plus
    /// hygiene, to the service answering). Suspend: the `mark` line's pauses. Bytes: its `stored_bytes_second` (a
    /// mark of a sandbox that already had one, as a suspend after work is).
    pub fn from_ct_bench(text: &str, source_name: &str) -> Result<Self, CostError> {
        let mut resume_ms = Vec::new();
        let mut mark = None;
        for v in lines(text) {
            match v["bench"].as_str() {
                Some("start") => resume_ms.extend(v["restore_hygiene_ms"].as_f64()),
                Some("mark") => mark = Some(v),
                _ => {}
            }
        }
        let mark = mark.ok_or_else(|| incomplete(source_name, "no \"mark\" line; rerun `./x bench ct`"))?;
        if resume_ms.is_empty() {
            return Err(incomplete(source_name, "no \"start\" lines with restore_hygiene_ms; rerun `./x bench ct`"));
        }
        let suspend_ms: Vec<f64> =
            ["pause_ms_first", "pause_ms_second"].iter().filter_map(|k| mark[*k].as_f64()).collect();
        if suspend_ms.is_empty() {
            return Err(incomplete(source_name, "the \"mark\" line has no pause_ms_*; rerun `./x bench ct`"));
        }
        let bytes = mark["stored_bytes_second"].as_f64();
        let mut sources = BTreeMap::new();
        sources.insert(
            "resume_ms".into(),
            format!("{source_name}: \"start\" lines, restore_hygiene_ms ({} samples)", resume_ms.len()),
        );
        sources.insert("suspend_ms".into(), format!("{source_name}: \"mark\" line, pause_ms_first/second"));
        if bytes.is_some() {
            sources.insert("suspend_bytes".into(), format!("{source_name}: \"mark\" line, stored_bytes_second"));
        }
        Ok(Self { backend: "ct".into(), resume_ms, suspend_ms, suspend_bytes: bytes, resume_bytes: None, sources })
    }

    /// From the ledger's operations log: `suspend` ops (their duration; bytes from their mark), and `resume` ops (the
    /// CLI's end-to-end resume), or else `restore` ops of a sandbox that had been suspended before.
    pub fn from_ops(ops: &[OpSample], backend: &str, source_name: &str) -> Result<Self, CostError> {
        let ok: Vec<&OpSample> = ops.iter().filter(|o| o.ok && o.backend == backend).collect();
        let suspends: Vec<&&OpSample> = ok.iter().filter(|o| o.op == "suspend").collect();
        if suspends.is_empty() {
            return Err(incomplete(source_name, format!("no successful {backend} suspend recorded")));
        }
        let mut resume: Vec<f64> = ok.iter().filter(|o| o.op == "resume").map(|o| o.duration_ms).collect();
        let mut how = "resume ops";
        if resume.is_empty() {
            how = "restore ops after a suspend of the same sandbox";
            resume = ok
                .iter()
                .filter(|o| o.op == "restore")
                .filter(|r| {
                    suspends
                        .iter()
                        .any(|s| s.sandbox.is_some() && s.sandbox == r.sandbox && s.started_ms <= r.started_ms)
                })
                .map(|o| o.duration_ms)
                .collect();
        }
        if resume.is_empty() {
            return Err(incomplete(source_name, format!("{backend} suspends recorded but no resume after them")));
        }
        let suspend_ms: Vec<f64> = suspends.iter().map(|o| o.duration_ms).collect();
        let bytes: Vec<f64> = suspends.iter().filter_map(|o| o.stored_bytes).map(|b| b as f64).collect();
        let suspend_bytes = (!bytes.is_empty()).then(|| bytes.iter().sum::<f64>() / bytes.len() as f64);
        let mut sources = BTreeMap::new();
        sources.insert("resume_ms".into(), format!("{source_name}: {how} ({} samples)", resume.len()));
        sources.insert("suspend_ms".into(), format!("{source_name}: suspend ops ({} samples)", suspend_ms.len()));
        if suspend_bytes.is_some() {
            sources.insert(
                "suspend_bytes".into(),
                format!("{source_name}: mean stored_bytes of {} suspend marks", bytes.len()),
            );
        }
        Ok(Self { backend: backend.into(), resume_ms: resume, suspend_ms, suspend_bytes, resume_bytes: None, sources })
    }

    /// Bytes per resume: the measured figure, or the suspend's stored bytes.
    pub fn resume_bytes_or_suspend(&self) -> Option<f64> {
        self.resume_bytes.or(self.suspend_bytes)
    }

    /// The source notes, including the assumption behind resume bytes when they were not measured apart.
    pub fn source_notes(&self) -> BTreeMap<String, String> {
        let mut s = self.sources.clone();
        if self.resume_bytes.is_none() {
            s.entry("resume_bytes".into()).or_insert_with(|| match self.suspend_bytes {
                Some(_) => {
                    "taken as suspend_bytes (the mark's new objects; the image's base cached on every host)".into()
                }
                None => "not measured".into(),
            });
        }
        s.entry("suspend_bytes".into()).or_insert_with(|| "not measured".into());
        s
    }
}

/// One entry of the ledger's operations log, as the CLI hands it over.
#[derive(Debug, Clone, PartialEq)]
pub struct OpSample {
    pub op: String,
    pub backend: String,
    pub sandbox: Option<String>,
    pub started_ms: i64,
    pub duration_ms: f64,
    pub ok: bool,
    /// The stored bytes of the op's mark, when it has one.
    pub stored_bytes: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_vm_bench_figures() {
        let text = format!(
            "{}\nnoise\n{}\n",
            serde_json::json!({"name": VM_RESUME_FIGURE, "value": 480.0, "samples": [470.0, 480.0, 510.0], "detail": {"accel": "tcg"}}),
            serde_json::json!({"name": VM_SUSPEND_FIGURE, "value": 20.0, "samples": [18.0, 22.0], "detail": {"accel": "tcg", "last": {"mark_stored_bytes": 33554432}}})
        );
        let m = Measured::from_vm_bench(&text, "bench/out/vm.jsonl").unwrap();
        assert_eq!(m.backend, "vm (tcg)");
        assert_eq!(m.resume_ms, vec![470.0, 480.0, 510.0]);
        assert_eq!(m.suspend_ms, vec![18.0, 22.0]);
        assert_eq!(m.suspend_bytes, Some(33554432.0));
        assert!(m.sources["resume_ms"].contains("bench/out/vm.jsonl"));
        assert!(m.source_notes()["resume_bytes"].contains("suspend_bytes"));
        let e = Measured::from_vm_bench("{\"name\":\"other\"}\n", "vm.jsonl").unwrap_err().to_string();
        assert!(e.contains("rerun `./x bench vm`"), "{e}");
    }

    #[test]
    fn reads_ct_bench_lines() {
        let text = [
            r#"{"bench":"mark","pause_ms_first":90.0,"pause_ms_second":60.0,"stored_bytes_second":1000}"#,
            r#"{"bench":"start","i":0,"cold_ms":900.0,"restore_hygiene_ms":300.0}"#,
            r#"{"bench":"start","i":1,"cold_ms":900.0,"restore_hygiene_ms":320.0}"#,
        ]
        .join("\n");
        let m = Measured::from_ct_bench(&text, "ct.jsonl").unwrap();
        assert_eq!((m.resume_ms.clone(), m.suspend_ms.clone()), (vec![300.0, 320.0], vec![90.0, 60.0]));
        assert_eq!(m.suspend_bytes, Some(1000.0));
        assert!(Measured::from_ct_bench(r#"{"bench":"start","restore_hygiene_ms":1}"#, "ct.jsonl").is_err());
    }

    fn op(op: &str, sbx: &str, t: i64, d: f64, bytes: Option<u64>) -> OpSample {
        OpSample {
            op: op.into(),
            backend: "ct".into(),
            sandbox: Some(sbx.into()),
            started_ms: t,
            duration_ms: d,
            ok: true,
            stored_bytes: bytes,
        }
    }

    #[test]
    fn reads_ledger_ops() {
        // A restore before the suspend (the sandbox's first start) is not a resume; the one after is.
        let ops = vec![
            op("restore", "a", 0, 999.0, None),
            op("suspend", "a", 10, 150.0, Some(4000)),
            op("restore", "a", 20, 400.0, None),
            op("restore", "b", 30, 888.0, None),
        ];
        let m = Measured::from_ops(&ops, "ct", "ledger").unwrap();
        assert_eq!(m.resume_ms, vec![400.0]);
        assert_eq!(m.suspend_ms, vec![150.0]);
        assert_eq!(m.suspend_bytes, Some(4000.0));
        // Explicit resume ops win.
        let mut with_resume = ops.clone();
        with_resume.push(op("resume", "a", 20, 700.0, None));
        assert_eq!(Measured::from_ops(&with_resume, "ct", "ledger").unwrap().resume_ms, vec![700.0]);
        assert!(Measured::from_ops(&ops, "vm", "ledger").is_err());
        assert!(Measured::from_ops(&ops[..2], "ct", "ledger").unwrap_err().to_string().contains("no resume"));
    }
}
