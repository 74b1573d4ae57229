//! Chat messages → the prompt text, through the model's chat template (Jinja, as a Hugging Face
//! `tokenizer_config.json` writes it; the `chat_template` parameter of the model's config), else
//! ChatML. The template sees `messages` (role and content), `add_generation_prompt` (true),
//! `bos_token` and `eos_token` (the `bos_token`/`eos_token` parameters, else empty) and
//! `raise_exception`. Its work is bounded (fuel) and so is the prompt it makes.
use minijinja::{Environment, Error as JinjaError, ErrorKind, Value, context};
use serde::Serialize;

/// ChatML: what many chat models were trained on.
const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// Template instructions one rendering may run.
const FUEL: u64 = 2_000_000;

#[derive(Debug, Serialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

/// The prompt for `messages`; `limit` bounds its length in bytes.
pub fn render(
    template: Option<&str>,
    messages: &[Message],
    (bos, eos): (&str, &str),
    limit: usize,
) -> Result<String, String> {
    let mut env = Environment::new();
    env.set_fuel(Some(FUEL));
    env.add_function("raise_exception", |msg: String| -> Result<Value, JinjaError> {
        Err(JinjaError::new(ErrorKind::InvalidOperation, msg))
    });
    let source = template.unwrap_or(CHATML);
    let t = env.template_from_str(source).map_err(|e| format!("the model's chat template does not parse: {e}"))?;
    let prompt = t
        .render(context! { messages => messages, add_generation_prompt => true, bos_token => bos, eos_token => eos })
        .map_err(|e| format!("the chat template failed on these messages: {e}"))?;
    if prompt.len() > limit {
        return Err(format!("the chat template made a prompt of {} bytes, more than {limit}", prompt.len()));
    }
    Ok(prompt)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msgs() -> Vec<Message> {
        vec![
            Message { role: "system".into(), content: "Be brief.".into() },
            Message { role: "user".into(), content: "Hi".into() },
        ]
    }

    #[test]
    fn chatml_by_default_and_the_models_template_when_set() {
        let p = render(None, &msgs(), ("", ""), 1 << 20).unwrap();
        assert_eq!(
            p,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        let t = "{{ bos_token }}{% for m in messages %}[{{ m.role|upper }}] {{ m.content }}\n{% endfor %}";
        assert_eq!(render(Some(t), &msgs(), ("<s>", ""), 1 << 20).unwrap(), "<s>[SYSTEM] Be brief.\n[USER] Hi\n");
        let raising = "{% if messages[0].role == 'system' %}{{ raise_exception('no system role') }}{% endif %}";
        assert!(render(Some(raising), &msgs(), ("", ""), 1 << 20).unwrap_err().contains("no system role"));
        assert!(render(Some("{% for"), &msgs(), ("", ""), 1 << 20).unwrap_err().contains("does not parse"));
    }

    #[test]
    fn runaway_templates_stop() {
        let big = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}";
        assert!(render(Some(big), &msgs(), ("", ""), 1 << 20).is_err());
        assert!(render(None, &msgs(), ("", ""), 10).unwrap_err().contains("more than 10"));
    }
}
