//! Chat templates rendered as `transformers`' `apply_chat_template` renders them: the golden
//! file (`benches/reference/chat_template_golden.py`) holds five templates — the shared SmolLM2
//! file's own, and templates in the styles of Llama 3, Mistral and Llama 2 — on three
//! conversations with and without the generation prompt, including the ones a template refuses.

use std::path::Path;

use ringtmp_pretrained::template::{ChatMessage, ChatTemplate};

#[test]
fn every_golden_template_renders_as_transformers_renders_it() {
    let golden: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../benches/reference/templates/chat-templates.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let (bos, eos) = (
        golden["bos_token"].as_str().unwrap(),
        golden["eos_token"].as_str().unwrap(),
    );
    let extra = golden["extra"].as_object().unwrap().clone();
    let cases = golden["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 30);
    for case in cases {
        let name = case["template"].as_str().unwrap();
        let source = golden["templates"][name].as_str().unwrap();
        let template = ChatTemplate::new(source, bos, eos).expect("compiles");
        let messages: Vec<ChatMessage> = serde_json::from_value(case["messages"].clone()).unwrap();
        let prompt = case["add_generation_prompt"].as_bool().unwrap();
        let rendered = template.render(&messages, prompt, &extra);
        match (case.get("rendered"), case.get("error")) {
            (Some(expected), _) => assert_eq!(
                rendered.unwrap_or_else(|e| panic!("{name}: {e}")),
                expected.as_str().unwrap(),
                "{name}, generation prompt {prompt}, {} messages",
                messages.len()
            ),
            (None, Some(error)) => {
                let e = rendered.expect_err("refused").to_string();
                assert!(e.contains(error.as_str().unwrap()), "{name}: {e} / {error}");
            }
            (None, None) => panic!("a case with neither"),
        }
    }
}

#[test]
fn a_template_that_does_not_compile_is_an_error() {
    let e = ChatTemplate::new("{% for m in messages %}", "<s>", "</s>")
        .err()
        .expect("refused")
        .to_string();
    assert!(e.starts_with("chat template:"), "{e}");
}
