//! Chat messages → the prompt text, through the model's chat template (Jinja, as a Hugging Face
//! `tokenizer_config.json` writes it; the `chat_template` parameter of the model's config), else
//! ChatML. The template sees `messages` (role and content), `add_generation_prompt` (true),
//! `bos_token` and `eos_token` (the `bos_token`/`eos_token` parameters, else empty) and
//! `raise_exception` and `strftime_now`, and Python's string and list methods (`.strip()`,
//! `.startswith()`, ...) as Hugging Face's templates use them. Its work is bounded (fuel) and so
//! is the prompt it makes: writing stops at the limit. Callers run it off the async workers.
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

/// Why a prompt could not be made.
#[derive(Debug, PartialEq)]
pub enum Failure {
    /// The model's template is broken (the server's problem).
    Template(String),
    /// The template refused these messages, or they make too long a prompt (the client's).
    Messages(String),
}

/// The prompt's bytes, refused past the limit.
struct Bounded {
    out: Vec<u8>,
    limit: usize,
}

impl std::io::Write for Bounded {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.out.len() + buf.len() > self.limit {
            return Err(std::io::Error::other("prompt too long"));
        }
        self.out.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// `strftime_now(format)`: the UTC date and time; `%d %b %Y %m %B %H %M %S %y %%` are known.
fn strftime_now(format: String) -> String {
    let now = crate::clock::Utc::now();
    let (year, month, day) = (now.year, now.month, now.day);
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let name = MONTHS[(month - 1) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year % 100)),
            Some('b') => out.push_str(&name[..3]),
            Some('B') => out.push_str(name),
            Some('H') => out.push_str(&format!("{:02}", now.hour)),
            Some('M') => out.push_str(&format!("{:02}", now.minute)),
            Some('S') => out.push_str(&format!("{:02}", now.second)),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// The prompt for `messages`; `limit` bounds its length in bytes.
pub fn render(
    template: Option<&str>,
    messages: &[Message],
    (bos, eos): (&str, &str),
    limit: usize,
) -> Result<String, Failure> {
    let mut env = Environment::new();
    env.set_fuel(Some(FUEL));
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", |msg: String| -> Result<Value, JinjaError> {
        Err(JinjaError::new(ErrorKind::InvalidOperation, msg))
    });
    env.add_function("strftime_now", strftime_now);
    let source = template.unwrap_or(CHATML);
    let t = env
        .template_from_str(source)
        .map_err(|e| Failure::Template(format!("the model's chat template does not parse: {e}")))?;
    let mut out = Bounded { out: Vec::new(), limit };
    let ctx = context! { messages => messages, add_generation_prompt => true, bos_token => bos, eos_token => eos };
    match t.render_captured_to(ctx, &mut out) {
        Ok(_) => {
            String::from_utf8(out.out).map_err(|_| Failure::Template("the chat template made invalid UTF-8".into()))
        }
        Err(e) if e.kind() == ErrorKind::WriteFailure => {
            Err(Failure::Messages(format!("the chat template made a prompt longer than {limit} bytes")))
        }
        Err(e) if e.kind() == ErrorKind::InvalidOperation => {
            Err(Failure::Messages(format!("the chat template refused these messages: {e}")))
        }
        Err(e) => Err(Failure::Template(format!("the model's chat template failed: {e}"))),
    }
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
        let refused = render(Some(raising), &msgs(), ("", ""), 1 << 20).unwrap_err();
        assert!(matches!(&refused, Failure::Messages(m) if m.contains("no system role")), "{refused:?}");
        assert!(matches!(render(Some("{% for"), &msgs(), ("", ""), 1 << 20), Err(Failure::Template(_))));
        // Python's methods and Hugging Face's helpers, as real templates use them.
        let py = "{{ messages[0].content.strip().upper() }}{% if messages[1].content.startswith('H') %}!{% endif %}\
                  {% macro m(x) %}<{{ x }}>{% endmacro %}{{ m(strftime_now('%Y')|length) }}";
        assert_eq!(render(Some(py), &msgs(), ("", ""), 1 << 20).unwrap(), "BE BRIEF.!<4>");
    }

    #[test]
    fn runaway_templates_stop() {
        let big = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}";
        assert!(render(Some(big), &msgs(), ("", ""), 1 << 20).is_err());
        let long = render(None, &msgs(), ("", ""), 10).unwrap_err();
        assert!(matches!(&long, Failure::Messages(m) if m.contains("longer than 10")), "{long:?}");
        // Writing stops at the limit: a huge prompt is never held.
        let huge = "{% for i in range(1000) %}{{ 'x' * 1000000 }}{% endfor %}";
        assert!(matches!(render(Some(huge), &msgs(), ("", ""), 1 << 20), Err(Failure::Messages(_))));
    }
}
