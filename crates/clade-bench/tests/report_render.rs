//! The benchmark report renders as a reader would see it: `clade-bench report` over bench outputs (fixtures in
//! the benches' own shapes), then Debian's Chromium headless loads report.html: the DOM has the summary and
//! every figure, and the screenshot is a page with plots on it (not blank, several colours), kept beside the
//! report for a person to look at.

use std::path::Path;
use std::process::Command;

const CHROMIUM: &str = "/usr/bin/chromium";

fn chromium(args: &[&str]) -> std::process::Output {
    let profile = tempfile::tempdir().unwrap();
    Command::new(CHROMIUM)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .args(args)
        .output()
        .expect("run chromium")
}

#[test]
fn report_renders_in_headless_chromium() {
    if !Path::new(CHROMIUM).exists() {
        eprintln!("skip: {CHROMIUM} is not installed (run ./x setup)");
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let out = d.path();
    std::fs::write(
        out.join("vm.jsonl"),
        concat!(
            r#"{"name":"vm cold boot / fork from warm pool","value":120.0,"unit":"x","bar":">= 20","pass":true,"samples":[],"detail":{"plot":{"kind":"arms","unit":"ms","arms":{"cold":[3900,4100,4400],"fork from pool":[14,18,25]}}}}"#,
            "\n",
            r#"{"name":"vm host memory per added idle sibling","value":0.16,"unit":"x cold","bar":"<= 0.15","pass":false,"samples":[],"detail":{"plot":{"kind":"xy","xlabel":"siblings","ylabel":"sum PSS MiB","x":[1,4,8,12],"series":{"siblings":[90,120,160,200]}}}}"#,
            "\n",
            r#"{"name":"vm retake end to end","value":275.0,"unit":"ms","bar":"<= 500","pass":true,"samples":[250,275,300,290,260]}"#,
            "\n"
        ),
    )
    .unwrap();
    std::fs::write(out.join("ct.jsonl"), "{\"bench\":\"start\",\"i\":0,\"cold_ms\":250}\n").unwrap();
    let st = Command::new(env!("CARGO_BIN_EXE_clade-bench"))
        .args(["report", "--dir"])
        .arg(out)
        .env("CLADE_HOME", out.join("home"))
        .status()
        .unwrap();
    assert!(st.success());
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("report.json")).unwrap()).unwrap();
    assert_eq!(report["figures"].as_array().unwrap().len(), 3);
    assert_eq!(report["raw"]["ct.jsonl"].as_array().unwrap().len(), 1, "per-sample lines are kept");
    assert!(report["machine"]["cores"].as_u64().unwrap() >= 1);

    let url = format!("file://{}", out.join("report.html").display());
    let dom = chromium(&["--dump-dom", &url]);
    let dom = String::from_utf8_lossy(&dom.stdout);
    assert!(dom.contains("clade benchmark report"), "{dom:.400}");
    assert!(dom.contains("2 PASS") && dom.contains("1 FAIL"), "the summary counts verdicts: {dom:.800}");
    assert_eq!(dom.matches("<svg").count(), 3, "one plot per figure");

    let shot = out.join("report.png");
    let o = chromium(&[&format!("--screenshot={}", shot.display()), "--window-size=1000,1600", &url]);
    assert!(shot.exists(), "no screenshot: {}", String::from_utf8_lossy(&o.stderr));
    let decoder = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(&shot).unwrap()));
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).unwrap();
    let px = info.color_type.samples();
    let pixels: Vec<&[u8]> = buf[..info.buffer_size()].chunks(px).collect();
    let inked = pixels.iter().filter(|p| p[..3].iter().any(|&c| c < 200)).count();
    let colours: std::collections::HashSet<[u8; 3]> =
        pixels.iter().map(|p| [p[0] & 0xf0, p[1] & 0xf0, p[2] & 0xf0]).collect();
    assert!(inked * 100 > pixels.len(), "the page is almost blank: {inked} of {} pixels inked", pixels.len());
    assert!(colours.len() > 8, "plots and badges bring colour: {} colours", colours.len());
    // Kept for a person to look at (`./x test` leaves it in target/).
    let keep = Path::new(env!("CARGO_TARGET_TMPDIR")).join("report-screenshot.png");
    let _ = std::fs::copy(&shot, &keep);
    eprintln!("screenshot: {}", keep.display());
}
