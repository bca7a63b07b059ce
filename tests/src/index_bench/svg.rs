//! A dependency-free SVG bar chart of the benchmark's sustained rates: one group per corpus
//! (trace x workers), one bar per backend, the value and the lookup p99 printed on each bar.

use std::fmt::Write;

pub struct Bar {
    pub backend: String,
    pub value: f64,
    pub note: String,
}

pub struct Group {
    pub label: String,
    pub bars: Vec<Bar>,
}

const COLORS: [&str; 4] = ["#2b7bba", "#e6892e", "#8c8c8c", "#6aa84f"];

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// Render `groups` (values in block ops/s) with `title`.
pub fn bar_chart(title: &str, subtitle: &str, groups: &[Group]) -> String {
    let bars_per_group = groups
        .iter()
        .map(|g| g.bars.len())
        .max()
        .unwrap_or(1)
        .max(1);
    let bar_w = 46.0;
    let gap = 40.0;
    let group_w = bars_per_group as f64 * bar_w + gap;
    let left = 70.0;
    let top = 70.0;
    let plot_h = 300.0;
    let width = left + groups.len().max(1) as f64 * group_w + 20.0;
    let legend_h = 22.0 * bars_per_group as f64;
    let height = top + plot_h + 60.0 + legend_h;
    let max = groups
        .iter()
        .flat_map(|g| g.bars.iter().map(|b| b.value))
        .fold(0.0f64, f64::max)
        .max(1.0);
    // A round axis maximum in M ops/s.
    let max_m = max / 1e6;
    let step = [0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0]
        .into_iter()
        .find(|s| max_m / s <= 6.0)
        .unwrap_or(200.0);
    let axis_m = (max_m / step).ceil() * step;
    let y = |v: f64| top + plot_h - (v / 1e6) / axis_m * plot_h;

    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0}" height="{height:.0}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{left}" y="24" font-size="16" font-weight="bold">{}</text>"#,
        escape(title)
    );
    let _ = writeln!(
        s,
        r##"<text x="{left}" y="44" fill="#555">{}</text>"##,
        escape(subtitle)
    );
    let mut tick = 0.0;
    while tick <= axis_m + 1e-9 {
        let ty = top + plot_h - tick / axis_m * plot_h;
        let _ = writeln!(
            s,
            r##"<line x1="{left}" x2="{:.0}" y1="{ty:.1}" y2="{ty:.1}" stroke="#ddd"/><text x="{:.0}" y="{:.1}" text-anchor="end">{tick}</text>"##,
            width - 20.0,
            left - 6.0,
            ty + 4.0
        );
        tick += step;
    }
    let _ = writeln!(
        s,
        r#"<text transform="translate(18,{:.0}) rotate(-90)" text-anchor="middle">sustained block ops/s (millions)</text>"#,
        top + plot_h / 2.0
    );
    for (gi, group) in groups.iter().enumerate() {
        let gx = left + gap / 2.0 + gi as f64 * group_w;
        for (bi, bar) in group.bars.iter().enumerate() {
            let x = gx + bi as f64 * bar_w;
            let by = y(bar.value);
            let color = COLORS[bi % COLORS.len()];
            let _ = writeln!(
                s,
                r#"<rect x="{x:.1}" y="{by:.1}" width="{:.1}" height="{:.1}" fill="{color}"/>"#,
                bar_w - 6.0,
                top + plot_h - by
            );
            let _ = writeln!(
                s,
                r#"<text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="10">{:.1}</text>"#,
                x + (bar_w - 6.0) / 2.0,
                by - 4.0,
                bar.value / 1e6
            );
            let _ = writeln!(
                s,
                r#"<text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="9" fill="white">{}</text>"#,
                x + (bar_w - 6.0) / 2.0,
                (top + plot_h - 6.0).min(by + 14.0).max(by + 10.0),
                escape(&bar.note)
            );
        }
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            gx + bars_per_group as f64 * bar_w / 2.0 - 3.0,
            top + plot_h + 18.0,
            escape(&group.label)
        );
    }
    if let Some(first) = groups.first() {
        for (bi, bar) in first.bars.iter().enumerate() {
            let ly = top + plot_h + 44.0 + bi as f64 * 20.0;
            let _ = writeln!(
                s,
                r#"<rect x="{left}" y="{:.1}" width="14" height="14" fill="{}"/><text x="{:.0}" y="{:.1}">{}</text>"#,
                ly - 11.0,
                COLORS[bi % COLORS.len()],
                left + 20.0,
                ly,
                escape(&bar.backend)
            );
        }
    }
    s.push_str("</svg>\n");
    s
}
