//! Latency summaries and SVG charts for benchmark reports.

use std::fmt::Write;
use std::time::Duration;

/// Percentile (0..=100) of `samples` by nearest rank; 0 for an empty set.
pub fn percentile(samples: &[Duration], p: f64) -> Duration {
    if samples.is_empty() {
        return Duration::ZERO;
    }
    let mut v = samples.to_vec();
    v.sort();
    let rank = ((p / 100.0) * v.len() as f64).ceil().max(1.0) as usize;
    v[rank.min(v.len()) - 1]
}

pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// One line of a CDF chart.
pub struct Series<'a> {
    pub label: String,
    pub samples: &'a [Duration],
}

const COLORS: &[&str] = &[
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#17becf", "#7f7f7f",
];

/// Latency CDFs (x: milliseconds, log scale; y: fraction of requests) as a standalone SVG.
pub fn cdf_svg(title: &str, series: &[Series<'_>]) -> String {
    let (w, h, left, right, top, bottom) = (760.0, 420.0, 70.0, 220.0, 40.0, 50.0);
    let all: Vec<f64> = series
        .iter()
        .flat_map(|s| s.samples.iter().map(|d| ms(*d).max(1e-3)))
        .collect();
    let lo = all
        .iter()
        .copied()
        .fold(f64::INFINITY, f64::min)
        .max(1e-3)
        .log10()
        .floor();
    let hi = all
        .iter()
        .copied()
        .fold(0.0f64, f64::max)
        .max(1e-2)
        .log10()
        .ceil()
        .max(lo + 1.0);
    let x = |v: f64| left + (v.max(1e-3).log10() - lo) / (hi - lo) * (w - left - right);
    let y = |f: f64| top + (1.0 - f) * (h - top - bottom);
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12"><rect width="100%" height="100%" fill="white"/><text x="{}" y="22" font-size="15" text-anchor="middle">{title}</text>"#,
        (w - right + left) / 2.0
    );
    let mut e = lo;
    while e <= hi {
        let xv = x(10f64.powf(e));
        let _ = write!(
            s,
            r##"<line x1="{xv}" y1="{top}" x2="{xv}" y2="{}" stroke="#ddd"/><text x="{xv}" y="{}" text-anchor="middle">{}</text>"##,
            h - bottom,
            h - bottom + 16.0,
            fmt_ms(10f64.powf(e))
        );
        e += 1.0;
    }
    for f in [0.0, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0] {
        let yv = y(f);
        let _ = write!(
            s,
            r##"<line x1="{left}" y1="{yv}" x2="{}" y2="{yv}" stroke="#eee"/><text x="{}" y="{}" text-anchor="end">{f}</text>"##,
            w - right,
            left - 6.0,
            yv + 4.0
        );
    }
    let _ = write!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">latency (ms, log scale)</text><text x="16" y="{}" transform="rotate(-90 16 {})" text-anchor="middle">fraction of requests</text>"#,
        (w - right + left) / 2.0,
        h - 10.0,
        h / 2.0,
        h / 2.0
    );
    for (i, ser) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let mut v: Vec<f64> = ser.samples.iter().map(|d| ms(*d)).collect();
        v.sort_by(f64::total_cmp);
        let n = v.len().max(1) as f64;
        // At most ~400 points per line: a CDF drawn from every sample of a long run would
        // make the file huge without changing the picture.
        let step = (v.len() / 400).max(1);
        let pts: Vec<String> = v
            .iter()
            .enumerate()
            .filter(|(k, _)| k % step == 0 || *k + 1 == v.len())
            .map(|(k, ms)| format!("{:.1},{:.1}", x(*ms), y((k + 1) as f64 / n)))
            .collect();
        let _ = write!(
            s,
            r#"<polyline fill="none" stroke="{color}" stroke-width="2" points="{}"/><rect x="{}" y="{}" width="12" height="12" fill="{color}"/><text x="{}" y="{}">{}</text>"#,
            pts.join(" "),
            w - right + 12.0,
            top + 18.0 * i as f64,
            w - right + 30.0,
            top + 18.0 * i as f64 + 10.0,
            ser.label
        );
    }
    s.push_str("</svg>\n");
    s
}

fn fmt_ms(v: f64) -> String {
    if v >= 1.0 {
        format!("{v:.0}")
    } else {
        format!("{v}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_by_nearest_rank() {
        let v: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        assert_eq!(percentile(&v, 50.0), Duration::from_millis(50));
        assert_eq!(percentile(&v, 99.0), Duration::from_millis(99));
        assert_eq!(percentile(&v, 100.0), Duration::from_millis(100));
        assert_eq!(percentile(&[], 50.0), Duration::ZERO);
    }

    #[test]
    fn svg_has_one_line_per_series() {
        let a = vec![Duration::from_micros(300), Duration::from_millis(2)];
        let svg = cdf_svg(
            "t",
            &[
                Series {
                    label: "a".into(),
                    samples: &a,
                },
                Series {
                    label: "b".into(),
                    samples: &a,
                },
            ],
        );
        assert!(svg.starts_with("<svg"));
        assert_eq!(svg.matches("<polyline").count(), 2);
    }
}
