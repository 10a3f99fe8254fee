//! Latency summaries: exact percentiles over recorded samples.

use serde::Serialize;
use std::time::Duration;

/// Median, p99 and friends of a set of durations, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Default)]
pub struct Summary {
    /// Number of samples.
    pub count: usize,
    /// 50th percentile, ms.
    pub median_ms: f64,
    /// 99th percentile, ms.
    pub p99_ms: f64,
    /// Arithmetic mean, ms.
    pub mean_ms: f64,
    /// Largest sample, ms.
    pub max_ms: f64,
}

impl Summary {
    /// Summarises `samples`; all fields are zero when there are none.
    pub fn of(samples: &[Duration]) -> Self {
        let mut ms: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1e3).collect();
        ms.sort_by(f64::total_cmp);
        if ms.is_empty() {
            return Self::default();
        }
        Self {
            count: ms.len(),
            median_ms: percentile_sorted(&ms, 50.0),
            p99_ms: percentile_sorted(&ms, 99.0),
            mean_ms: ms.iter().sum::<f64>() / ms.len() as f64,
            max_ms: ms[ms.len() - 1],
        }
    }
}

/// The `p`-th percentile (0..=100) of ascending `sorted` samples, linearly interpolated between
/// closest ranks (the definition numpy uses by default). `NaN` for an empty slice.
pub fn percentile_sorted(sorted: &[f64], p: f64) -> f64 {
    match sorted.len() {
        0 => f64::NAN,
        1 => sorted[0],
        n => {
            let rank = (p.clamp(0.0, 100.0) / 100.0) * (n - 1) as f64;
            let lo = rank.floor() as usize;
            let hi = rank.ceil() as usize;
            let frac = rank - lo as f64;
            sorted[lo] + (sorted[hi] - sorted[lo]) * frac
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_match_numpy_linear() {
        let v: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(percentile_sorted(&v, 50.0), 5.5);
        assert!((percentile_sorted(&v, 99.0) - 9.91).abs() < 1e-9);
        assert_eq!(percentile_sorted(&v, 0.0), 1.0);
        assert_eq!(percentile_sorted(&v, 100.0), 10.0);
        assert_eq!(percentile_sorted(&[3.0], 99.0), 3.0);
        assert!(percentile_sorted(&[], 50.0).is_nan());
    }

    #[test]
    fn summary_sorts_and_converts_to_ms() {
        let s = Summary::of(&[Duration::from_millis(30), Duration::from_millis(10), Duration::from_millis(20)]);
        assert_eq!(s.count, 3);
        assert!((s.median_ms - 20.0).abs() < 1e-9);
        assert!((s.mean_ms - 20.0).abs() < 1e-9);
        assert!((s.max_ms - 30.0).abs() < 1e-9);
        assert!(s.p99_ms > 29.0 && s.p99_ms <= 30.0);
        assert_eq!(Summary::of(&[]), Summary::default());
    }
}
