//! The HTML report of a tuning run: one self-contained page (inline SVG and CSS, no script, no
//! network) that reads on a phone and prints. The recommendation and its reasons first, then
//! the charts (throughput against latency with the Pareto front, the best configs against
//! concurrency, batch sizes formed, memory, the in-process ceiling), the machine, and every
//! number as a table whose cells carry the JSON report's values as `data-` attributes.
use std::fmt::Write;

use super::{
    machine::Machine,
    outcome::{Run, Verdict},
    search::Measured,
    svg::{self, Chart, Dot, Rule, Series, esc},
};

const MIB: f64 = 1024.0 * 1024.0;

const STYLE: &str = "
:root{--fg:#1b1f24;--muted:#5b6470;--line:#d8dde3;--accent:#0b6bcb;--good:#1a7f37;--bad:#c2410c}
*{box-sizing:border-box}
body{overflow-wrap:break-word;font:15px/1.45 system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;color:var(--fg);margin:0 auto;max-width:1000px;padding:16px}
h1{font-size:1.5rem;margin:.2rem 0}h2{font-size:1.15rem;margin:1.6rem 0 .4rem;border-bottom:1px solid var(--line);padding-bottom:.2rem}
p.meta,.note{color:var(--muted);margin:.2rem 0}
.headline{font-size:1.1rem;font-weight:600}
.card{border:1px solid var(--line);border-radius:8px;padding:12px 14px;margin:.6rem 0}
.card.infeasible{border-color:var(--bad)}
.grid2{display:grid;grid-template-columns:1fr 1fr;gap:12px}
svg.chart{width:100%;height:auto;display:block;background:#fff}
svg .grid{stroke:#eef1f4}svg .axis{stroke:#8a949e}
svg .tick,svg .label,svg .rule-label{font-size:12px;fill:var(--muted)}
svg .rule{stroke-dasharray:6 4;stroke-width:1.5}svg .budget{stroke:var(--bad);fill:var(--bad)}
svg .server{stroke:var(--good);fill:var(--good)}
svg .line{fill:none;stroke-width:2}svg .pareto{stroke:var(--fg);stroke-dasharray:3 3;stroke-width:1.5}
svg .dot{fill-opacity:.75}svg .dot.chosen{fill:none;stroke:var(--fg);stroke-width:3}
svg .bar{fill:#9fb6cd}svg .bar.chosen{fill:var(--accent)}
ul.legend{list-style:none;padding:0;margin:.3rem 0;display:flex;flex-wrap:wrap;gap:4px 14px;font-size:.85rem;color:var(--muted)}
ul.legend span{display:inline-block;width:10px;height:10px;border-radius:50%;margin-right:5px}
.scroll{overflow-x:auto}
table{border-collapse:collapse;font-size:.85rem;width:100%}
th,td{padding:3px 8px;border-bottom:1px solid var(--line);text-align:right;white-space:nowrap}
th:nth-child(2),td:nth-child(2){text-align:left}
tr.chosen td{background:#e8f1fb;font-weight:600}tr.sub td{color:var(--muted)}
dl{display:grid;grid-template-columns:minmax(0,max-content) minmax(0,1fr);gap:2px 14px;margin:.4rem 0}dt{color:var(--muted)}dd{margin:0;min-width:0}
pre{background:#f6f8fa;padding:10px;border-radius:6px;overflow-x:auto;font-size:.8rem}
code{font-size:.85rem;overflow-wrap:anywhere}
.grid2>div{min-width:0}
@media (max-width:640px){body{padding:10px;font-size:14px}.grid2{grid-template-columns:1fr}dl{grid-template-columns:minmax(0,1fr)}dd{margin-bottom:6px}}
@media print{body{max-width:none;padding:0;font-size:11pt}h2{break-after:avoid}.card,svg.chart,table{break-inside:avoid}
 details{display:block}details>*{display:block}.scroll{overflow:visible}a{color:inherit}}
";

/// The series colours, `s0`..`s7`: marks and lines in the charts, swatches in the legends.
const PALETTE: [&str; 8] = ["#0b6bcb", "#c2410c", "#1a7f37", "#8250df", "#bf8700", "#0e7490", "#be185d", "#57606a"];

fn palette_css() -> String {
    let mut css = String::new();
    for (i, c) in PALETTE.iter().enumerate() {
        let _ = write!(css, ".s{i}{{fill:{c};stroke:{c}}}ul.legend span.s{i}{{background:{c}}}");
    }
    css + "ul.legend span.pareto{background:none;border:1px dashed #1b1f24}"
}

fn class(i: usize) -> String {
    format!("s{}", i % 8)
}

fn legend(items: &[(String, String)]) -> String {
    let mut out = String::from(r#"<ul class="legend">"#);
    for (class, name) in items {
        let _ = write!(out, r#"<li><span class="{class}"></span>{}</li>"#, esc(name));
    }
    out.push_str("</ul>");
    out
}

/// Samples no other sample beats on both throughput and latency, by throughput.
fn pareto(points: &[(f64, f64)]) -> Vec<(f64, f64)> {
    let mut front: Vec<(f64, f64)> = points
        .iter()
        .copied()
        .filter(|&(t, l)| !points.iter().any(|&(t2, l2)| t2 >= t && l2 <= l && (t2 > t || l2 < l)))
        .collect();
    front.sort_by(|a, b| a.0.total_cmp(&b.0));
    front.dedup();
    front
}

struct Page<'a> {
    run: &'a Run<'a>,
    verdict: &'a Verdict,
    names: Vec<String>,
    pct: &'static str,
}

impl Page<'_> {
    fn label(&self, i: usize, m: &Measured) -> String {
        let current = if m.baseline { " (current)" } else { "" };
        format!("#{} {}{current}", i + 1, m.describe(&self.names))
    }

    fn latency(&self, m: &Measured, j: usize) -> f64 {
        m.worst_latency(j, self.run.constraints.percentile)
    }

    fn scatter(&self) -> String {
        let run = self.run;
        let mut series = Vec::new();
        let mut all = Vec::new();
        let mut names = Vec::new();
        for (i, m) in run.measured.iter().enumerate() {
            let dots: Vec<Dot> = (0..m.samples.len())
                .filter(|&j| m.clean(j))
                .map(|j| {
                    let (t, l) = (m.samples[j].throughput, self.latency(m, j));
                    all.push((t, l));
                    Dot {
                        x: t,
                        y: l,
                        title: format!(
                            "{} at concurrency {}: {t:.1} requests/s, {} {l:.3} ms",
                            self.label(i, m),
                            m.samples[j].concurrency,
                            self.pct
                        ),
                        data: vec![
                            ("point", i.to_string()),
                            ("concurrency", m.samples[j].concurrency.to_string()),
                            ("throughput", t.to_string()),
                            ("latency", l.to_string()),
                        ],
                    }
                })
                .collect();
            names.push((class(i), self.label(i, m)));
            series.push(Series { name: self.label(i, m), class: class(i), dots, line: false, marks: true });
        }
        let front: Vec<Dot> =
            pareto(&all).into_iter().map(|(x, y)| Dot { x, y, title: String::new(), data: Vec::new() }).collect();
        series.push(Series {
            name: "Pareto front".into(),
            class: "pareto".into(),
            dots: front,
            line: true,
            marks: false,
        });
        if let Some(p) = self.verdict.pick {
            let m = &run.measured[p.point];
            let (t, l) = (m.samples[p.sample].throughput, self.latency(m, p.sample));
            let dot = Dot {
                x: t,
                y: l,
                title: format!("recommended: {}", self.label(p.point, m)),
                data: vec![("point", p.point.to_string()), ("throughput", t.to_string()), ("latency", l.to_string())],
            };
            series.push(Series {
                name: "recommended".into(),
                class: "chosen".into(),
                dots: vec![dot],
                line: false,
                marks: true,
            });
        }
        let rules = run
            .constraints
            .latency_ms
            .map(|b| vec![Rule { y: b, label: format!("budget: {} <= {b} ms", self.pct), class: "budget" }])
            .unwrap_or_default();
        let who = if self.names.len() > 1 { " (all models together; the slowest model's latency)" } else { "" };
        let chart = Chart {
            id: "chart-pareto".into(),
            x_label: format!("requests/s{who}"),
            y_label: format!("{} latency, ms", self.pct),
            series,
            rules,
            x_log2: false,
        };
        let mut out = svg::render(&chart);
        names.push(("pareto".into(), "Pareto front".into()));
        out += &legend(&names);
        out
    }

    /// The recommended config and the next two by throughput.
    fn best_few(&self) -> Vec<usize> {
        let run = self.run;
        let top = |m: &Measured| {
            (0..m.samples.len()).filter(|&j| m.clean(j)).map(|j| m.samples[j].throughput).fold(0.0, f64::max)
        };
        let mut order: Vec<usize> = (0..run.measured.len()).collect();
        order.sort_by(|&a, &b| top(&run.measured[b]).total_cmp(&top(&run.measured[a])));
        if let Some(p) = self.verdict.pick {
            order.retain(|&i| i != p.point);
            order.insert(0, p.point);
        }
        order.truncate(3);
        order
    }

    fn by_concurrency(&self) -> String {
        let run = self.run;
        let few = self.best_few();
        let lines = |latency: bool| -> Vec<Series> {
            few.iter()
                .enumerate()
                .map(|(n, &i)| {
                    let m = &run.measured[i];
                    let dots = (0..m.samples.len())
                        .filter(|&j| m.clean(j))
                        .map(|j| {
                            let s = &m.samples[j];
                            let y = if latency { self.latency(m, j) } else { s.throughput };
                            Dot {
                                x: s.concurrency as f64,
                                y,
                                title: format!("{} at concurrency {}: {y:.3}", self.label(i, m), s.concurrency),
                                data: vec![("point", i.to_string()), ("concurrency", s.concurrency.to_string())],
                            }
                        })
                        .collect();
                    Series { name: self.label(i, m), class: class(n), dots, line: true, marks: true }
                })
                .collect()
        };
        let t = Chart {
            id: "chart-throughput".into(),
            x_label: "concurrent clients".into(),
            y_label: "requests/s".into(),
            series: lines(false),
            rules: Vec::new(),
            x_log2: true,
        };
        let budget = run.constraints.latency_ms.map(|b| Rule { y: b, label: "budget".into(), class: "budget" });
        let l = Chart {
            id: "chart-latency".into(),
            x_label: "concurrent clients".into(),
            y_label: format!("{} latency, ms", self.pct),
            series: lines(true),
            rules: budget.into_iter().collect(),
            x_log2: true,
        };
        let names: Vec<(String, String)> =
            few.iter().enumerate().map(|(n, &i)| (class(n), self.label(i, &run.measured[i]))).collect();
        format!(
            r#"<div class="grid2"><div>{}</div><div>{}</div></div>{}"#,
            svg::render(&t),
            svg::render(&l),
            legend(&names)
        )
    }

    fn bars(&self) -> String {
        let run = self.run;
        let chosen = self.verdict.pick.map(|p| p.point);
        let batches: Vec<(String, f64, String)> = run
            .measured
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let s = m.samples.last();
                let b = s.map_or(0.0, |s| s.avg_batch);
                let c = s.map_or(0, |s| s.concurrency);
                ((i + 1).to_string(), b, format!("{}: {b:.2} rows per execution at concurrency {c}", self.label(i, m)))
            })
            .collect();
        let memory: Vec<(String, f64, String)> = run
            .measured
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let mib = m.memory_bytes() as f64 / MIB;
                ((i + 1).to_string(), mib, format!("{}: {mib:.1} MiB held by the instances", self.label(i, m)))
            })
            .collect();
        format!(
            r#"<div class="grid2"><div><h3>Rows per execution (at the highest concurrency)</h3>{}</div><div><h3>Memory the instances hold, MiB</h3>{}</div></div>"#,
            svg::bars("chart-batch", "rows per execution", &batches, chosen),
            svg::bars("chart-memory", "MiB", &memory, chosen)
        )
    }

    fn ceilings(&self) -> String {
        let run = self.run;
        let mut out = String::new();
        for (k, (sub, points)) in run.subjects.iter().zip(run.ceilings).enumerate() {
            if points.is_empty() {
                continue;
            }
            let dots = points
                .iter()
                .map(|p| Dot {
                    x: p.batch as f64,
                    y: p.rows_per_sec,
                    title: format!("batch {}: {:.1} rows/s, p50 {:.3} ms", p.batch, p.rows_per_sec, p.p50_ms),
                    data: vec![("batch", p.batch.to_string()), ("rows", p.rows_per_sec.to_string())],
                })
                .collect();
            let rules = self
                .verdict
                .pick
                .map(|p| {
                    let t = run.measured[p.point].per_model[k][p.sample].throughput;
                    vec![Rule {
                        y: t,
                        label: format!("through the server, recommended: {t:.0} requests/s"),
                        class: "server",
                    }]
                })
                .unwrap_or_default();
            let chart = Chart {
                id: if k == 0 { "chart-ceiling".into() } else { format!("chart-ceiling-{}", k + 1) },
                x_label: "batch size".into(),
                y_label: "rows/s".into(),
                series: vec![Series { name: "in-process".into(), class: class(0), dots, line: true, marks: true }],
                rules,
                x_log2: true,
            };
            let _ = write!(
                out,
                "<div><h3>'{}': the backend alone, one instance, {} intra-op threads</h3>{}</div>",
                esc(&sub.name),
                run.settings.cores,
                svg::render(&chart)
            );
        }
        if out.is_empty() {
            out = r#"<p class="note">Not measured: the ceiling runs for batching ONNX models whose file is in a local folder.</p>"#.into();
        }
        out
    }

    fn numbers(&self) -> String {
        let run = self.run;
        let mut out = String::from(
            r#"<div class="scroll"><table id="numbers"><thead><tr><th>#</th><th>config</th><th>model</th><th>clients</th><th>req/s</th><th>p50 ms</th><th>p95 ms</th><th>p99 ms</th><th>rows/exec</th><th>load</th><th>MiB</th><th>errors</th></tr></thead><tbody>"#,
        );
        let chosen = self.verdict.pick;
        for (i, m) in run.measured.iter().enumerate() {
            for (j, s) in m.samples.iter().enumerate() {
                let is = chosen.is_some_and(|p| p.point == i && p.sample == j);
                let mut rows = vec![(None, s, m.memory_bytes())];
                if self.names.len() > 1 {
                    rows.extend((0..self.names.len()).map(|k| (Some(k), &m.per_model[k][j], m.model_bytes[k])));
                }
                for (k, s, bytes) in rows {
                    let model = k.map_or("all".to_string(), |k| self.names[k].clone());
                    let cls = match (k, is) {
                        (None, true) => r#" class="chosen""#,
                        (Some(_), _) => r#" class="sub""#,
                        _ => "",
                    };
                    let metrics: [(&str, f64, usize); 6] = [
                        ("throughput", s.throughput, 1),
                        ("p50", s.p50_ms, 3),
                        ("p95", s.p95_ms, 3),
                        ("p99", s.p99_ms, 3),
                        ("batch", s.avg_batch, 2),
                        ("load", s.load, 1),
                    ];
                    let attrs: String = metrics.iter().map(|(n, v, _)| format!(r#" data-{n}="{v}""#)).collect();
                    let cells: String = metrics.iter().map(|(_, v, d)| format!("<td>{v:.d$}</td>")).collect();
                    let first = j == 0 && k.is_none();
                    let _ = write!(
                        out,
                        r#"<tr{cls} data-point="{i}" data-model="{}" data-concurrency="{}"{attrs} data-bytes="{bytes}" data-errors="{}"><td>{}</td><td>{}</td><td>{}</td><td>{}</td>{cells}<td>{:.1}</td><td>{}</td></tr>"#,
                        esc(&model),
                        s.concurrency,
                        s.errors,
                        if first { (i + 1).to_string() } else { String::new() },
                        if first { esc(&self.label(i, m)) } else { String::new() },
                        esc(&model),
                        s.concurrency,
                        bytes as f64 / MIB,
                        s.errors
                    );
                }
            }
        }
        out.push_str("</tbody></table></div>");
        out
    }

    fn recommendation(&self) -> String {
        let (run, v) = (self.run, self.verdict);
        let mut out = String::new();
        if let Some(why) = &v.infeasible {
            let _ = write!(
                out,
                r#"<div class="card infeasible" id="infeasible"><p class="headline">{}</p><pre>{}</pre></div>"#,
                if why.all_failed { "No config ran without errors." } else { "No config met the constraints." },
                esc(&run.why_not(why))
            );
            return out;
        }
        let Some(p) = v.pick else { return out };
        let m = &run.measured[p.point];
        let _ = write!(
            out,
            r#"<div class="card" id="recommended" data-point="{}" data-concurrency="{}">"#,
            p.point, m.samples[p.sample].concurrency
        );
        if let Some((first, rest)) = v.reasons.split_first() {
            let _ = write!(out, r#"<p class="headline">{}</p><ul>"#, esc(first));
            for r in rest {
                let _ = write!(out, "<li>{}</li>", esc(r));
            }
            out.push_str("</ul>");
        }
        for (k, sub) in run.subjects.iter().enumerate() {
            let changes = super::report::changes(&sub.current, &m.points[k]);
            let what = if changes.is_empty() { "kept as it is".to_string() } else { changes.join("; ") };
            let _ = write!(
                out,
                "<details><summary><b>{}</b>: {}</summary><pre>{}</pre></details>",
                esc(&sub.name),
                esc(&what),
                esc(&v.configs[k])
            );
        }
        out.push_str("</div>");
        if let Some(z) = &v.sizing {
            let _ = write!(
                out,
                r#"<div class="card" id="sizing"><p><b>Sizing:</b> {}</p><p>At this point the server held {:.1} requests queued or executing (<code>ferry_inference_load</code>); scale out above {}:</p><dl>"#,
                esc(&z.headline()),
                z.measured_load,
                z.inference_load_target
            );
            for (platform, setting) in z.autoscaling() {
                let _ = write!(out, "<dt>{}</dt><dd><code>{}</code></dd>", esc(platform), esc(&setting));
            }
            out.push_str("</dl></div>");
        }
        out
    }
}

pub fn page(run: &Run<'_>, verdict: &Verdict, machine: &Machine) -> String {
    let names = run.names();
    let page = Page { run, verdict, names: names.clone(), pct: run.constraints.percentile.label() };
    let title = format!("ferry tune: {}", names.join(", "));
    let constraints = run.constraints.describe();
    let mut out = String::new();
    let _ = write!(
        out,
        r#"<!doctype html><html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1"><title>{}</title><style>{STYLE}{}</style></head><body>"#,
        esc(&title),
        palette_css()
    );
    let _ = write!(
        out,
        r#"<header><h1>{}</h1><p class="meta">{} · {} cores · {:.0} s of a {:.0} s budget · {} configs measured · constraints: {}</p></header>"#,
        esc(&title),
        esc(&machine.finished),
        machine.cores,
        run.elapsed_secs,
        run.settings.budget.as_secs_f64(),
        run.measured.len(),
        esc(if constraints.is_empty() { "none" } else { &constraints })
    );
    let _ = write!(out, "<h2>Recommendation</h2>{}", page.recommendation());
    let _ = write!(
        out,
        "<h2>Throughput against {} latency, every config at every concurrency</h2>{}",
        page.pct,
        page.scatter()
    );
    let _ = write!(out, "<h2>The best configs against concurrency</h2>{}", page.by_concurrency());
    let _ = write!(out, "<h2>Batches and memory</h2>{}", page.bars());
    let _ = write!(out, r#"<h2>In-process ceiling</h2><div class="grid2">{}</div>"#, page.ceilings());
    let _ = write!(
        out,
        r#"<h2>Machine</h2><dl id="machine"><dt>CPU</dt><dd>{}</dd><dt>cores used</dt><dd>{}</dd><dt>memory</dt><dd>{} MiB</dd><dt>OS</dt><dd>{}</dd><dt>ferry</dt><dd>{}</dd></dl><p class="note">The numbers hold for this machine; measure again on the machine you deploy to.</p>"#,
        esc(&machine.cpu),
        machine.cores,
        machine.memory_mib,
        esc(&machine.os),
        esc(&machine.ferry)
    );
    let _ = write!(out, "<h2>Every number</h2>{}", page.numbers());
    out.push_str("</body></html>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::pareto;

    #[test]
    fn the_pareto_front_keeps_only_undominated_points() {
        let pts = [(100.0, 2.0), (200.0, 3.0), (150.0, 4.0), (300.0, 9.0), (250.0, 10.0)];
        assert_eq!(pareto(&pts), vec![(100.0, 2.0), (200.0, 3.0), (300.0, 9.0)]);
        assert!(pareto(&[]).is_empty());
    }
}
