//! The graph of serving ensembles, checked whenever an ensemble loads: no cycle through the one
//! loading (the first request would recurse without end), and no chain of ensembles deeper than
//! [`MAX_NESTING`], counting the ensembles above it that already call it.
use std::{collections::HashMap, sync::Arc};

use super::Ensemble;
use crate::request::MAX_NESTING;

/// Checks `new` (about to serve under its name) against every serving ensemble version (by
/// model name; versions of `new`'s own name are the ones it replaces and are left out). Errors
/// name the path of the cycle, or of the deepest chain.
pub fn check(new: &Ensemble, serving: &[(String, Arc<Ensemble>)]) -> Result<(), String> {
    let mut by_name: HashMap<&str, Vec<&Ensemble>> = HashMap::new();
    for (name, e) in serving.iter().filter(|(n, _)| *n != new.name) {
        by_name.entry(name.as_str()).or_default().push(e);
    }
    by_name.insert(new.name.as_str(), vec![new]);
    let mut walk = Walk { by_name: &by_name, memo: HashMap::new() };
    let below = walk.down(&new.name, &mut Vec::new())?;
    let above = above(&new.name, &by_name);
    // `above` ends with the new ensemble and `below` starts with it.
    let chain: Vec<&str> = above.iter().copied().chain(below.iter().skip(1).copied()).collect();
    let depth = chain.iter().filter(|m| by_name.contains_key(*m)).count();
    if depth as u32 > MAX_NESTING {
        return Err(format!(
            "ensemble '{}' would nest {depth} ensembles deep ({}), over the limit of {MAX_NESTING}",
            new.name,
            chain.join(" -> ")
        ));
    }
    Ok(())
}

struct Walk<'a> {
    by_name: &'a HashMap<&'a str, Vec<&'a Ensemble>>,
    /// The deepest chain below each model seen, itself first.
    memo: HashMap<&'a str, Vec<&'a str>>,
}

impl<'a> Walk<'a> {
    /// The deepest chain of models from `model` down (itself first), or the cycle found on the
    /// way. `path` is the chain above it.
    fn down(&mut self, model: &'a str, path: &mut Vec<&'a str>) -> Result<Vec<&'a str>, String> {
        if let Some(at) = path.iter().position(|m| *m == model) {
            let cycle: Vec<&str> = path[at..].iter().copied().chain([model]).collect();
            return Err(format!("ensembles would call each other in a cycle: {}", cycle.join(" -> ")));
        }
        if let Some(known) = self.memo.get(model) {
            return Ok(known.clone());
        }
        let mut deepest = Vec::new();
        // Past the limit the answer is known: stop before the walk itself recurses too deep.
        if path.len() as u32 <= MAX_NESTING {
            path.push(model);
            let by_name = self.by_name;
            for e in by_name.get(model).into_iter().flatten() {
                for step in &e.steps {
                    let chain = self.down(&step.model, path)?;
                    if chain.len() > deepest.len() {
                        deepest = chain;
                    }
                }
            }
            path.pop();
        }
        let chain: Vec<&str> = [model].into_iter().chain(deepest).collect();
        self.memo.insert(model, chain.clone());
        Ok(chain)
    }
}

/// The deepest chain of serving ensembles that call `model`, ending with `model` (the graph
/// above it is acyclic: `down` looked first).
fn above<'a>(model: &'a str, by_name: &HashMap<&'a str, Vec<&'a Ensemble>>) -> Vec<&'a str> {
    fn up<'a>(
        model: &'a str,
        by_name: &HashMap<&'a str, Vec<&'a Ensemble>>,
        memo: &mut HashMap<&'a str, Vec<&'a str>>,
        height: u32,
    ) -> Vec<&'a str> {
        if let Some(known) = memo.get(model) {
            return known.clone();
        }
        let mut deepest: Vec<&str> = Vec::new();
        if height <= MAX_NESTING {
            for (&caller, versions) in by_name {
                if versions.iter().any(|e| e.steps.iter().any(|s| s.model == model)) {
                    let chain = up(caller, by_name, memo, height + 1);
                    if chain.len() > deepest.len() {
                        deepest = chain;
                    }
                }
            }
        }
        deepest.push(model);
        memo.insert(model, deepest.clone());
        deepest
    }
    up(model, by_name, &mut HashMap::new(), 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ensemble::Step;

    fn ensemble(name: &str, calls: &[&str]) -> Ensemble {
        let steps = calls
            .iter()
            .map(|m| Step { model: m.to_string(), version: None, inputs: vec![], outputs: vec![] })
            .collect();
        Ensemble { name: name.into(), steps, namespace: None }
    }

    fn serving(list: &[(&str, &[&str])]) -> Vec<(String, Arc<Ensemble>)> {
        list.iter().map(|(n, calls)| (n.to_string(), Arc::new(ensemble(n, calls)))).collect()
    }

    #[test]
    fn a_cycle_through_the_new_ensemble_is_refused_with_its_path() {
        // A serves and calls B; B is reloaded as an ensemble calling C, which calls A.
        let now = serving(&[("A", &["B"]), ("C", &["A", "m"])]);
        let e = check(&ensemble("B", &["C"]), &now).unwrap_err();
        assert_eq!(e, "ensembles would call each other in a cycle: B -> C -> A -> B");
        // The version of B it replaces does not count: B reloaded without the call is fine.
        let now = serving(&[("A", &["B"]), ("B", &["A"])]);
        assert!(check(&ensemble("B", &["m"]), &now).is_ok());
        assert!(check(&ensemble("B", &["B"]), &[]).unwrap_err().contains("B -> B"));
    }

    #[test]
    fn nesting_counts_the_callers_above_and_the_chain_below() {
        let limit = MAX_NESTING as usize;
        // e1 -> e2 -> ... -> e{limit}, then a plain model: exactly at the limit.
        let names: Vec<String> = (1..=limit).map(|i| format!("e{i}")).collect();
        let mut list: Vec<(String, Arc<Ensemble>)> = Vec::new();
        for (i, n) in names.iter().enumerate() {
            let next = names.get(i + 1).map_or("model", String::as_str);
            list.push((n.clone(), Arc::new(ensemble(n, &[next]))));
        }
        let (last, rest) = list.split_last().unwrap();
        assert!(check(&last.1, rest).is_ok());
        // The last one reloaded as a call to one more ensemble: over the limit, from above.
        let mut more = rest.to_vec();
        more.push(("x".into(), Arc::new(ensemble("x", &["model"]))));
        let e = check(&ensemble(&last.0, &["x"]), &more).unwrap_err();
        assert!(e.contains(&format!("would nest {} ensembles deep (e1 -> e2 -> ", limit + 1)), "{e}");
        assert!(e.ends_with(&format!("e{limit} -> x -> model), over the limit of {limit}")), "{e}");
        // A new ensemble on top of the whole chain: over the limit, from below.
        let e = check(&ensemble("top", &["e1"]), &list).unwrap_err();
        assert!(e.starts_with(&format!("ensemble 'top' would nest {} ensembles deep (top -> e1", limit + 1)), "{e}");
    }
}
