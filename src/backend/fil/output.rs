//! What `output__0` holds, from FIL's `output_class` (or its newer name `is_classifier`),
//! `predict_proba` and `threshold`, and the arithmetic that makes it from the framework's
//! prediction.
use super::Forest;
use crate::proto::inference::ModelConfig;

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Output {
    /// The framework's prediction as it is (regression values, or probabilities of a
    /// multi-class model when it is not asked for classes).
    Scores,
    /// A probability per class; a binary model's one probability p becomes `[1 - p, p]`.
    Proba,
    /// The class id: above `threshold` or not for a binary model, else the likeliest class.
    Class { threshold: f32 },
}

impl Output {
    pub fn of(config: &ModelConfig, forest: &dyn Forest) -> Result<Output, String> {
        let param = |key: &str| config.parameters.get(key).map(|p| p.string_value.trim());
        let flag = |key: &str| -> Result<bool, String> {
            match param(key).map(str::to_ascii_lowercase).as_deref() {
                None | Some("") | Some("false") | Some("0") => Ok(false),
                Some("true") | Some("1") => Ok(true),
                Some(other) => {
                    Err(format!("model '{}': parameter {key} is '{other}'; expected true or false", config.name))
                }
            }
        };
        let classifier = flag("output_class")? || flag("is_classifier")?;
        if (classifier || flag("predict_proba")?) && forest.targets() > 1 {
            return Err(format!(
                "model '{}': output_class and predict_proba take a model of one target; this one predicts {} \
                 (its output__0 holds each target's values, as the model gives them)",
                config.name,
                forest.targets()
            ));
        }
        let threshold =
            match param("threshold") {
                None | Some("") => 0.5,
                Some(v) => v.parse::<f32>().ok().filter(|t| t.is_finite()).ok_or_else(|| {
                    format!("model '{}': parameter threshold is '{v}'; expected a number", config.name)
                })?,
            };
        if flag("predict_proba")? {
            if !forest.gives_probabilities() && !forest.gives_classes() {
                return Err(format!(
                    "model '{}': predict_proba needs a classifier, but the model's objective gives regression values",
                    config.name
                ));
            }
            if forest.gives_classes() {
                return Err(format!(
                    "model '{}': predict_proba needs class probabilities, but the model's objective \
                     (multi:softmax) gives class ids; train it with multi:softprob",
                    config.name
                ));
            }
            return Ok(Output::Proba);
        }
        Ok(if classifier && !forest.gives_classes() { Output::Class { threshold } } else { Output::Scores })
    }

    /// Values per row of the output, for a forest giving `k` per row.
    pub fn width(self, k: usize) -> usize {
        match self {
            Output::Scores => k,
            Output::Proba => k.max(2),
            Output::Class { .. } => 1,
        }
    }

    /// The output's bytes (FP32, little-endian) from `rows` rows of `k` values each.
    pub fn finish(self, scores: &[f32], rows: usize, k: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(rows * self.width(k) * 4);
        let mut put = |v: f32| out.extend_from_slice(&v.to_le_bytes());
        for row in scores.chunks_exact(k.max(1)).take(rows) {
            match self {
                Output::Scores => row.iter().copied().for_each(&mut put),
                Output::Proba if k == 1 => {
                    put(1.0 - row[0]);
                    put(row[0]);
                }
                Output::Proba => row.iter().copied().for_each(&mut put),
                Output::Class { threshold } if k == 1 => put(if row[0] > threshold { 1.0 } else { 0.0 }),
                Output::Class { .. } => {
                    let best = row.iter().enumerate().fold(0, |best, (i, &v)| if v > row[best] { i } else { best });
                    put(best as f32);
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn floats(b: &[u8]) -> Vec<f32> {
        b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
    }

    #[test]
    fn a_binary_models_probability_becomes_two_and_its_class_follows_the_threshold() {
        let p = [0.2f32, 0.7, 0.5];
        assert_eq!(floats(&Output::Proba.finish(&p, 3, 1)), vec![0.8, 0.2, 0.3, 0.7, 0.5, 0.5]);
        assert_eq!(floats(&Output::Class { threshold: 0.5 }.finish(&p, 3, 1)), vec![0.0, 1.0, 0.0]);
        assert_eq!(floats(&Output::Class { threshold: 0.1 }.finish(&p, 3, 1)), vec![1.0, 1.0, 1.0]);
        assert_eq!(Output::Proba.width(1), 2);
        assert_eq!(Output::Class { threshold: 0.5 }.width(1), 1);
    }

    #[test]
    fn a_multi_class_model_gives_its_likeliest_class_or_its_scores() {
        let s = [0.1f32, 0.6, 0.3, 0.5, 0.2, 0.3];
        assert_eq!(floats(&Output::Class { threshold: 0.5 }.finish(&s, 2, 3)), vec![1.0, 0.0]);
        assert_eq!(floats(&Output::Proba.finish(&s, 2, 3)), s.to_vec());
        assert_eq!(floats(&Output::Scores.finish(&s, 2, 3)), s.to_vec());
        assert_eq!(Output::Scores.width(3), 3);
    }

    #[test]
    fn a_tie_goes_to_the_first_class() {
        assert_eq!(floats(&Output::Class { threshold: 0.5 }.finish(&[0.4, 0.4, 0.2], 1, 3)), vec![0.0]);
    }
}
