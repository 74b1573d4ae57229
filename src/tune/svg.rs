//! Charts as inline SVG for the HTML report: scatter and line charts on linear (or base-2, for
//! concurrency and batch sizes) axes, and bar charts. No script: hovering a mark shows its
//! `<title>`, and every mark carries its numbers as `data-` attributes.
use std::fmt::Write;

const W: f64 = 640.0;
const H: f64 = 340.0;
const LEFT: f64 = 64.0;
const RIGHT: f64 = 16.0;
const TOP: f64 = 16.0;
const BOTTOM: f64 = 48.0;

/// Text safe inside HTML and SVG, attributes included.
pub fn esc(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

pub struct Dot {
    pub x: f64,
    pub y: f64,
    pub title: String,
    /// `data-NAME="VALUE"` attributes.
    pub data: Vec<(&'static str, String)>,
}

pub struct Series {
    pub name: String,
    /// CSS class: its colour (`s0`..`s5`) or its role (`pareto`, `chosen`).
    pub class: String,
    pub dots: Vec<Dot>,
    /// Joined by a line (in x order as given).
    pub line: bool,
    /// Dots drawn (a line alone when false).
    pub marks: bool,
}

pub struct Rule {
    pub y: f64,
    pub label: String,
    pub class: &'static str,
}

pub struct Chart {
    pub id: String,
    pub x_label: String,
    pub y_label: String,
    pub series: Vec<Series>,
    pub rules: Vec<Rule>,
    /// A base-2 x axis (1, 2, 4, ...).
    pub x_log2: bool,
}

/// About five round steps covering `lo..hi`.
fn ticks(lo: f64, hi: f64) -> Vec<f64> {
    let span = (hi - lo).max(f64::EPSILON);
    let raw = span / 5.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0].into_iter().map(|m| m * mag).find(|s| span / s <= 6.0).unwrap_or(10.0 * mag);
    let mut v = Vec::new();
    let mut t = (lo / step).ceil() * step;
    while t <= hi + step * 1e-9 && v.len() < 12 {
        v.push(t);
        t += step;
    }
    v
}

fn number(v: f64) -> String {
    if v.abs() >= 10_000.0 {
        format!("{:.0}k", v / 1000.0)
    } else if v.abs() >= 100.0 || v == v.round() {
        format!("{v:.0}")
    } else if v.abs() >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

struct Axes {
    x0: f64,
    x1: f64,
    y1: f64,
    log2: bool,
}

impl Axes {
    fn fx(&self, x: f64) -> f64 {
        let x = if self.log2 { x.max(1e-9).log2() } else { x };
        let span = (self.x1 - self.x0).max(f64::EPSILON);
        LEFT + (x - self.x0) / span * (W - LEFT - RIGHT)
    }

    fn fy(&self, y: f64) -> f64 {
        H - BOTTOM - y / self.y1.max(f64::EPSILON) * (H - TOP - BOTTOM)
    }
}

fn frame(out: &mut String, id: &str, x_label: &str, y_label: &str) {
    let _ = write!(
        out,
        r#"<svg class="chart" id="{id}" viewBox="0 0 {W} {H}" role="img" aria-label="{} against {}" preserveAspectRatio="xMidYMid meet">"#,
        esc(y_label),
        esc(x_label)
    );
    let _ = write!(
        out,
        r#"<text class="label" x="{}" y="{}" text-anchor="middle">{}</text><text class="label" transform="translate(14 {}) rotate(-90)" text-anchor="middle">{}</text>"#,
        (LEFT + W - RIGHT) / 2.0,
        H - 8.0,
        esc(x_label),
        (TOP + H - BOTTOM) / 2.0,
        esc(y_label)
    );
}

fn y_axis(out: &mut String, a: &Axes) {
    for t in ticks(0.0, a.y1) {
        let y = a.fy(t);
        let _ = write!(
            out,
            r#"<line class="grid" x1="{LEFT}" x2="{}" y1="{y:.1}" y2="{y:.1}"/><text class="tick" x="{}" y="{:.1}" text-anchor="end">{}</text>"#,
            W - RIGHT,
            LEFT - 6.0,
            y + 4.0,
            number(t)
        );
    }
}

fn dot_attrs(d: &Dot) -> String {
    d.data.iter().map(|(k, v)| format!(r#" data-{k}="{}""#, esc(v))).collect()
}

pub fn render(chart: &Chart) -> String {
    let all = chart.series.iter().flat_map(|s| &s.dots);
    let xs: Vec<f64> = all.clone().map(|d| if chart.x_log2 { d.x.max(1e-9).log2() } else { d.x }).collect();
    // The data set the scale; a rule far above it (a loose budget) is drawn at the top, said so,
    // rather than flattening every mark onto the axis.
    let data_top = all.map(|d| d.y).fold(0.0, f64::max);
    let ys = chart.rules.iter().map(|r| r.y).filter(|&y| data_top <= 0.0 || y <= data_top * 1.5).chain([data_top]);
    let (mut x0, mut x1) = xs.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &x| (a.min(x), b.max(x)));
    if !x0.is_finite() {
        (x0, x1) = (0.0, 1.0);
    }
    if chart.x_log2 {
        (x0, x1) = (x0.floor(), x1.ceil().max(x0.floor() + 1.0));
    } else {
        (x0, x1) = (0.0, if x1 > 0.0 { x1 * 1.08 } else { 1.0 });
    }
    let y1 = ys.fold(0.0, f64::max) * 1.1;
    let a = Axes { x0, x1, y1: if y1 > 0.0 { y1 } else { 1.0 }, log2: chart.x_log2 };
    let mut out = String::new();
    frame(&mut out, &chart.id, &chart.x_label, &chart.y_label);
    y_axis(&mut out, &a);
    let x_ticks: Vec<f64> =
        if chart.x_log2 { (x0 as i32..=x1 as i32).map(|e| 2f64.powi(e)).collect() } else { ticks(x0, x1) };
    for t in x_ticks {
        let x = a.fx(t);
        let _ = write!(
            out,
            r#"<text class="tick" x="{x:.1}" y="{}" text-anchor="middle">{}</text>"#,
            H - BOTTOM + 16.0,
            number(t)
        );
    }
    let _ =
        write!(out, r#"<line class="axis" x1="{LEFT}" x2="{}" y1="{}" y2="{}"/>"#, W - RIGHT, H - BOTTOM, H - BOTTOM);
    for r in &chart.rules {
        let above = r.y > a.y1;
        let y = a.fy(r.y.min(a.y1));
        let label = if above { format!("{} (above the chart)", r.label) } else { r.label.clone() };
        let _ = write!(
            out,
            r#"<line class="rule {}" x1="{LEFT}" x2="{}" y1="{y:.1}" y2="{y:.1}" data-value="{}"/><text class="rule-label {}" x="{}" y="{:.1}" text-anchor="end">{}</text>"#,
            r.class,
            W - RIGHT,
            r.y,
            r.class,
            W - RIGHT - 4.0,
            if above { y + 14.0 } else { y - 4.0 },
            esc(&label)
        );
    }
    for s in &chart.series {
        if s.line && s.dots.len() > 1 {
            let pts: Vec<String> = s.dots.iter().map(|d| format!("{:.1},{:.1}", a.fx(d.x), a.fy(d.y))).collect();
            let _ = write!(
                out,
                r#"<polyline class="line {}" points="{}"><title>{}</title></polyline>"#,
                s.class,
                pts.join(" "),
                esc(&s.name)
            );
        }
        if s.marks {
            let r = if s.class == "chosen" { 7.0 } else { 4.0 };
            for d in &s.dots {
                let _ = write!(
                    out,
                    r#"<circle class="dot {}" cx="{:.1}" cy="{:.1}" r="{r}"{}><title>{}</title></circle>"#,
                    s.class,
                    a.fx(d.x),
                    a.fy(d.y),
                    dot_attrs(d),
                    esc(&d.title)
                );
            }
        }
    }
    out.push_str("</svg>");
    out
}

/// One bar per item: (label, value, hover text).
pub fn bars(id: &'static str, y_label: &str, items: &[(String, f64, String)], highlight: Option<usize>) -> String {
    let y1 = items.iter().map(|i| i.1).fold(0.0, f64::max) * 1.1;
    let a = Axes { x0: 0.0, x1: 1.0, y1: if y1 > 0.0 { y1 } else { 1.0 }, log2: false };
    let mut out = String::new();
    frame(&mut out, id, "config (#, as in the table)", y_label);
    y_axis(&mut out, &a);
    let n = items.len().max(1) as f64;
    let band = (W - LEFT - RIGHT) / n;
    for (i, (label, v, title)) in items.iter().enumerate() {
        let x = LEFT + band * i as f64 + band * 0.15;
        let (y, h) = (a.fy(*v), a.fy(0.0) - a.fy(*v));
        let class = if highlight == Some(i) { "bar chosen" } else { "bar" };
        let _ = write!(
            out,
            r#"<rect class="{class}" x="{x:.1}" y="{y:.1}" width="{:.1}" height="{h:.1}" data-value="{v}"><title>{}</title></rect><text class="tick" x="{:.1}" y="{}" text-anchor="middle">{}</text>"#,
            band * 0.7,
            esc(title),
            x + band * 0.35,
            H - BOTTOM + 16.0,
            esc(label)
        );
    }
    let _ =
        write!(out, r#"<line class="axis" x1="{LEFT}" x2="{}" y1="{}" y2="{}"/>"#, W - RIGHT, H - BOTTOM, H - BOTTOM);
    out.push_str("</svg>");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_round_and_cover_the_range() {
        assert_eq!(ticks(0.0, 10.0), vec![0.0, 2.0, 4.0, 6.0, 8.0, 10.0]);
        let t = ticks(0.0, 1234.0);
        assert_eq!(t.first(), Some(&0.0));
        assert!(t.len() >= 3 && t.len() <= 7, "{t:?}");
        assert!(ticks(0.0, 0.0).len() <= 12);
    }

    #[test]
    fn marks_carry_their_numbers_and_text_is_escaped() {
        let dot = Dot { x: 4.0, y: 2.5, title: "a<b".into(), data: vec![("throughput", "2.5".into())] };
        let chart = Chart {
            id: "c".into(),
            x_label: "x & y".into(),
            y_label: "y".into(),
            series: vec![Series { name: "s".into(), class: "s0".into(), dots: vec![dot], line: false, marks: true }],
            rules: vec![Rule { y: 3.0, label: "budget".into(), class: "budget" }],
            x_log2: true,
        };
        let svg = render(&chart);
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>"));
        assert!(svg.contains(r#"data-throughput="2.5""#) && svg.contains("a&lt;b") && svg.contains("x &amp; y"));
        assert!(svg.contains(r#"class="rule budget""#));
        assert!(!svg.contains("NaN") && !svg.contains("inf"));
        // A rule far above the marks is drawn at the top and said to be above.
        let mut far = chart;
        far.rules[0].y = 500.0;
        let svg = render(&far);
        assert!(svg.contains("budget (above the chart)") && svg.contains(r#"data-value="500""#), "{svg}");
        let b = bars("b", "MiB", &[("1".into(), 3.0, "one".into()), ("2".into(), 0.0, "two".into())], Some(0));
        assert_eq!(b.matches("<rect").count(), 2);
        assert!(b.contains("bar chosen"));
    }
}
