//! The end of a tuning run: the recommendation (or why there is none), written as text on
//! stdout, a config.pbtxt per model, the JSON report and the HTML report.
use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use super::{
    html,
    machine::Machine,
    outcome::{Run, Verdict},
    report, request,
    search::Measured,
};

impl Run<'_> {
    /// Where each model's config goes: the file given (one model), or FOLDER/<model>/config.pbtxt.
    fn config_paths(&self) -> Option<Vec<PathBuf>> {
        let out = self.settings.output.as_ref()?;
        if self.subjects.len() == 1 && !crate::config::is_folder(out) {
            return Some(vec![out.clone()]);
        }
        Some(self.subjects.iter().map(|s| out.join(&s.name).join("config.pbtxt")).collect())
    }

    pub fn finish(&self) -> Result<(), String> {
        let verdict = self.verdict();
        let machine = Machine::read(self.settings.cores);
        let names = self.names();
        let mut out = String::new();
        let requests: Vec<String> =
            self.subjects.iter().map(|s| format!("{} {}", s.name, request::describe(&s.request))).collect();
        out += &format!(
            "ferry tune: {} on {} cores, {:.0} s of {:.0} s budget, {}\n\n",
            if names.len() == 1 { format!("model '{}'", names[0]) } else { format!("models {}", names.join(", ")) },
            self.settings.cores,
            self.elapsed_secs,
            self.settings.budget.as_secs_f64(),
            if names.len() == 1 {
                format!("request {}", request::describe(&self.subjects[0].request))
            } else {
                format!("requests: {}; mix {}", requests.join("; "), self.mix())
            }
        );
        for (s, c) in self.subjects.iter().zip(self.ceilings) {
            if !c.is_empty() {
                out += &report::ceiling_table(&s.name, c, self.settings.cores);
                out.push('\n');
            }
        }
        out += "Through the server (HTTP on loopback, binary tensors; queue, dynamic batcher, instances):\n";
        out += &report::table(self.measured, &names);
        out.push('\n');
        let result = match (&verdict.pick, &verdict.infeasible) {
            (Some(pick), _) => {
                let m = &self.measured[pick.point];
                let s = &m.samples[pick.sample];
                let within = self.constraints.describe();
                let within = if within.is_empty() { String::new() } else { format!(" within {within}") };
                out += &format!(
                    "Best{within}: {} at concurrency {}: {:.1} requests/s, p50 {:.3} ms, p95 {:.3} ms, p99 {:.3} ms\n",
                    m.describe(&names),
                    s.concurrency,
                    s.throughput,
                    s.p50_ms,
                    s.p95_ms,
                    s.p99_ms
                );
                if names.len() > 1 {
                    let pct = self.constraints.percentile;
                    let each: Vec<String> = names
                        .iter()
                        .zip(&m.per_model)
                        .map(|(n, ss)| {
                            let s = &ss[pick.sample];
                            format!("{n} {:.1} requests/s, {} {:.3} ms", s.throughput, pct.label(), s.latency(pct))
                        })
                        .collect();
                    out += &format!("  Each model: {}\n", each.join("; "));
                }
                for r in &verdict.reasons {
                    out += &format!("  {r}\n");
                }
                for (k, sub) in self.subjects.iter().enumerate() {
                    let changes = report::changes(&sub.current, &m.points[k]);
                    let who = if names.len() > 1 { format!(" of '{}'", sub.name) } else { String::new() };
                    if changes.is_empty() {
                        out += &format!("The current config{who} is kept.\n");
                    } else {
                        out += &format!("Changes from the current config{who}: {}\n", changes.join("; "));
                    }
                }
                if let Some(sizing) = &verdict.sizing {
                    out += &sizing.text();
                }
                match self.config_paths() {
                    Some(paths) => {
                        // A file that cannot be written loses nothing else: the rest is still
                        // written and printed, and the error comes last.
                        let mut failed = Ok(());
                        for (path, text) in paths.iter().zip(&verdict.configs) {
                            match write(path, text) {
                                Ok(()) => out += &format!("Recommended config written to {}\n", path.display()),
                                Err(e) => {
                                    out += &format!("\nRecommended config.pbtxt (not written: {e}):\n{text}");
                                    failed = failed.and(Err(e));
                                }
                            }
                        }
                        return self.write_reports(&verdict, &machine, out).and(failed);
                    }
                    None => {
                        for (name, text) in names.iter().zip(&verdict.configs) {
                            out += &format!("\nRecommended config.pbtxt of '{name}':\n{text}");
                        }
                    }
                }
                Ok(())
            }
            (None, Some(why)) => Err(self.why_not(why)),
            (None, None) => Err("nothing was measured".to_string()),
        };
        self.write_reports(&verdict, &machine, out).and(result)
    }

    /// The JSON and HTML reports, then the text on stdout, whatever fails to be written.
    fn write_reports(&self, verdict: &Verdict, machine: &Machine, mut out: String) -> Result<(), String> {
        let mut failed = Ok(());
        if let Some(path) = &self.settings.report {
            let text = serde_json::to_string_pretty(&self.json(verdict, machine)).map_err(|e| e.to_string())?;
            failed = failed.and(write(path, &text));
        }
        if let Some(path) = &self.settings.report_html {
            match write(path, &html::page(self, verdict, machine)) {
                Ok(()) => out += &format!("Report written to {}\n", path.display()),
                Err(e) => failed = failed.and(Err(e)),
            }
        }
        print!("{out}");
        failed
    }

    pub fn point_json(&self, m: &Measured) -> Value {
        let models: Vec<Value> = self
            .subjects
            .iter()
            .enumerate()
            .map(|(k, s)| {
                json!({"model": s.name, "point": m.points[k], "samples": m.per_model[k], "model_bytes": m.model_bytes[k]})
            })
            .collect();
        let mut v = json!({
            "baseline": m.baseline,
            "samples": m.samples,
            "memory_bytes": m.memory_bytes(),
            "resident_bytes": m.resident_bytes,
            "load_secs": m.load_secs,
            "models": models,
        });
        if self.subjects.len() == 1 {
            v["point"] = json!(m.points[0]);
            v["model_bytes"] = json!(m.model_bytes[0]);
        }
        v
    }

    fn json(&self, verdict: &Verdict, machine: &Machine) -> Value {
        let c = &self.constraints;
        let names = self.names();
        let best = verdict.pick.map(|p| {
            let m = &self.measured[p.point];
            let models: Vec<Value> = names
                .iter()
                .enumerate()
                .map(|(k, n)| {
                    json!({"model": n, "point": m.points[k], "sample": m.per_model[k][p.sample],
                        "config": verdict.configs[k]})
                })
                .collect();
            let mut v = json!({"index": p.point, "sample_index": p.sample, "sample": m.samples[p.sample],
                "reasons": verdict.reasons, "models": models});
            if names.len() == 1 {
                v["point"] = json!(m.points[0]);
                v["config"] = json!(verdict.configs[0]);
            }
            v
        });
        let infeasible = verdict.infeasible.as_ref().map(|i| {
            json!({"unmet": i.unmet, "closest": i.closest.map(|k| json!({"index": k.point, "sample_index": k.sample})),
                "all_failed": i.all_failed, "message": self.why_not(i)})
        });
        let models: Vec<Value> = self
            .subjects
            .iter()
            .zip(self.ceilings)
            .map(|(s, ceil)| {
                json!({"model": s.name, "weight": s.weight, "current": s.current, "ceiling": ceil,
                    "request": request::describe(&s.request)})
            })
            .collect();
        let mut v = json!({
            "models": models,
            "cores": self.settings.cores,
            "machine": machine,
            "budget_secs": self.settings.budget.as_secs_f64(),
            "elapsed_secs": self.elapsed_secs,
            "constraints": {
                "latency_budget_ms": c.latency_ms,
                "percentile": c.percentile.label(),
                "min_throughput": c.min_throughput,
                "max_memory_bytes": c.max_memory_bytes,
                "objective": match c.objective { crate::config::Objective::Throughput => "throughput", crate::config::Objective::Latency => "latency" },
            },
            "latency_target_ms": c.latency_ms,
            "points": self.measured.iter().map(|m| self.point_json(m)).collect::<Vec<_>>(),
            "best": best,
            "infeasible": infeasible,
            "sizing": verdict.sizing,
        });
        if names.len() == 1 {
            v["model"] = json!(names[0]);
            v["ceiling"] = json!(self.ceilings[0]);
        }
        v
    }
}

fn write(path: &Path, text: &str) -> Result<(), String> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    }
    std::fs::write(path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))
}
