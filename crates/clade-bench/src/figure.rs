//! A figure: one measured quantity with its samples, the bar it is held to, and whether it passed (computed
//! from the samples, never written by hand); and the summaries the benches compute (median, nearest-rank
//! percentile, least-squares slope).

use serde::Serialize;

/// One figure: samples, the summary the bar is about, the bar.
#[derive(Debug, Clone, Serialize)]
pub struct Figure {
    pub name: String,
    pub value: f64,
    pub unit: String,
    pub bar: String,
    pub pass: bool,
    pub samples: Vec<f64>,
    pub detail: serde_json::Value,
}

pub fn median(v: &[f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

/// The `q` quantile (0..=1) of `v`, nearest rank.
pub fn percentile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    s[((s.len() - 1) as f64 * q).round() as usize]
}

/// Least-squares slope of y over x.
pub fn slope(x: &[f64], y: &[f64]) -> f64 {
    let n = x.len() as f64;
    let mx = x.iter().sum::<f64>() / n;
    let my = y.iter().sum::<f64>() / n;
    let num: f64 = x.iter().zip(y).map(|(a, b)| (a - mx) * (b - my)).sum();
    let den: f64 = x.iter().map(|a| (a - mx) * (a - mx)).sum();
    num / den
}

#[cfg(test)]
mod tests {
    #[test]
    fn median_and_slope() {
        assert_eq!(super::median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(super::median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!((super::slope(&[1.0, 2.0, 3.0], &[2.0, 4.0, 6.0]) - 2.0).abs() < 1e-9);
    }
}
