//! The prompt shapes a client controls (a completions prompt, message content) and their
//! bounded, non-buffering deserializers.
//!
//! Exists because the obvious `#[serde(untagged)]` enums buffer a whole value before trying each
//! shape (about 32 bytes per JSON element), so a body's parse could take 16× its size or more:
//! a 32 MiB `[1,1,…]` prompt took ~0.5 GB. These visitors decide the shape from the first token
//! they see, write token ids straight into a `Vec<u32>`, and refuse more than
//! [`MAX_PROMPT_TOKENS`] ids, [`MAX_MESSAGES`] messages or [`MAX_PARTS`] parts, so a parse takes
//! at most a small multiple of the body, and never more than the caps allow, whatever its shape.

use std::cell::Cell;
use std::fmt;

use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::Deserialize;

use serde_json::value::RawValue;

/// The most token ids one request's prompt may hold (4 Mi): beyond any served context window, and
/// what bounds the memory a token-id prompt takes to 16 MiB whatever the body's size.
pub const MAX_PROMPT_TOKENS: usize = 1 << 22;
/// The most chat messages (or input items, or batched prompts) one request may hold.
pub const MAX_MESSAGES: usize = 1 << 16;
/// The most content parts one message may hold.
pub const MAX_PARTS: usize = 1 << 12;
/// The most list elements (messages, content parts, raw blocks or items) one whole body may
/// hold, whatever lists they are in (256 Ki): the per-list caps alone let 2,700 messages of
/// 4,096 `{}` parts each, 80 bytes parsed for 3 sent, take ~0.9 GB from one 32 MiB body. At
/// 256 Ki elements a parse takes at most ~40 MiB of them; a long agent conversation holds a
/// few thousand.
pub const MAX_ELEMENTS: usize = 1 << 18;

thread_local! {
    /// Elements the parse running on this thread may still read; `None` outside
    /// [`within_element_budget`]. A parse is synchronous, so one thread runs it whole.
    static ELEMENTS_LEFT: Cell<Option<usize>> = const { Cell::new(None) };
}

/// Runs `parse` (one body's deserialization) with at most [`MAX_ELEMENTS`] list elements in all.
pub fn within_element_budget<T>(parse: impl FnOnce() -> T) -> T {
    /// Puts back what was there before, even if the parse unwinds.
    struct Restore(Option<usize>);
    impl Drop for Restore {
        fn drop(&mut self) {
            ELEMENTS_LEFT.set(self.0);
        }
    }
    let _restore = Restore(ELEMENTS_LEFT.replace(Some(MAX_ELEMENTS)));
    parse()
}

/// Takes one element from the running parse's budget; false when it is spent.
fn take_element() -> bool {
    match ELEMENTS_LEFT.get() {
        None => true,
        Some(0) => false,
        Some(n) => {
            ELEMENTS_LEFT.set(Some(n - 1));
            true
        }
    }
}

/// A completions prompt in any of its four shapes.
///
/// Deserialized by hand (see [`PromptVisitor`]), not as an untagged enum: serde buffers an
/// untagged value whole before trying each shape, about 32 bytes per array element, so a 32 MiB
/// token-id array would take ~0.5 GB. Here token ids go straight into a `Vec<u32>` and their
/// count is capped by [`MAX_PROMPT_TOKENS`].
#[derive(Debug)]
pub enum Prompt {
    /// One string.
    Text(String),
    /// A batch of strings.
    Texts(Vec<String>),
    /// One prompt as token ids.
    Tokens(Vec<u32>),
    /// A batch of token-id prompts.
    TokenLists(Vec<Vec<u32>>),
}

/// Message content.
#[derive(Debug)]
pub enum Content {
    /// Plain text.
    Text(String),
    /// Typed parts (text, image_url, input_audio, ...).
    Parts(Vec<ContentPart>),
}

/// One content part. Non-text parts contribute their raw JSON, so two different images differ.
#[derive(Debug, Deserialize)]
pub struct ContentPart {
    /// `text`, `image_url`, ...
    #[serde(rename = "type", default)]
    pub kind: String,
    /// The text of a text part.
    #[serde(default)]
    pub text: Option<String>,
    /// An image part's payload, as sent (raw: no tree is built for it).
    #[serde(default)]
    pub image_url: Option<Box<RawValue>>,
    /// An audio part's payload, as sent.
    #[serde(default)]
    pub input_audio: Option<Box<RawValue>>,
}

/// Reads a sequence of `T` into a vector of at most `cap` elements; `what` names them in the
/// error. The vector grows as elements arrive (no trust in a size hint).
fn capped_seq<'de, A, T>(mut seq: A, cap: usize, what: &str) -> Result<Vec<T>, A::Error>
where
    A: SeqAccess<'de>,
    T: Deserialize<'de>,
{
    let mut out = Vec::new();
    while let Some(item) = seq.next_element::<T>()? {
        if out.len() == cap {
            return Err(de::Error::custom(format!("more than {cap} {what}")));
        }
        if !take_element() {
            return Err(de::Error::custom(format!(
                "the body holds more than {MAX_ELEMENTS} messages, parts and items in all"
            )));
        }
        out.push(item);
    }
    Ok(out)
}

/// Token ids after the first, into `ids`, keeping the running total `total` under the cap.
fn more_ids<'de, A: SeqAccess<'de>>(
    seq: &mut A,
    ids: &mut Vec<u32>,
    total: &mut usize,
) -> Result<(), A::Error> {
    while let Some(id) = seq.next_element::<u32>()? {
        *total += 1;
        if *total > MAX_PROMPT_TOKENS {
            return Err(de::Error::custom(format!(
                "the prompt has more than {MAX_PROMPT_TOKENS} token ids"
            )));
        }
        ids.push(id);
    }
    Ok(())
}

/// The first element of a prompt array, which fixes the array's shape.
enum First {
    Text(String),
    Id(u32),
    Ids(Vec<u32>),
}

/// A nested token-id list, counted against the prompt's total.
struct IdList<'t>(&'t mut usize);

impl<'de> de::DeserializeSeed<'de> for IdList<'_> {
    type Value = Vec<u32>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Vec<u32>, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for IdList<'_> {
    type Value = Vec<u32>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a list of token ids")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<u32>, A::Error> {
        let mut ids = Vec::new();
        more_ids(&mut seq, &mut ids, self.0)?;
        Ok(ids)
    }
}

/// The first element: a string, a token id or a token-id list.
struct FirstSeed<'t>(&'t mut usize);

impl<'de> de::DeserializeSeed<'de> for FirstSeed<'_> {
    type Value = First;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<First, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for FirstSeed<'_> {
    type Value = First;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string, a token id or a list of token ids")
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<First, E> {
        Ok(First::Text(v.to_owned()))
    }
    fn visit_string<E: de::Error>(self, v: String) -> Result<First, E> {
        Ok(First::Text(v))
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<First, E> {
        *self.0 += 1;
        u32::try_from(v)
            .map(First::Id)
            .map_err(|_| E::custom("a token id must fit in 32 bits"))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<First, A::Error> {
        IdList(self.0).visit_seq(seq).map(First::Ids)
    }
}

struct PromptVisitor;

impl<'de> Visitor<'de> for PromptVisitor {
    type Value = Prompt;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string, a list of strings, a list of token ids or a list of such lists")
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Prompt, E> {
        Ok(Prompt::Text(v.to_owned()))
    }
    fn visit_string<E: de::Error>(self, v: String) -> Result<Prompt, E> {
        Ok(Prompt::Text(v))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Prompt, A::Error> {
        let mut total = 0usize;
        let Some(first) = seq.next_element_seed(FirstSeed(&mut total))? else {
            return Ok(Prompt::Tokens(Vec::new()));
        };
        match first {
            First::Text(t) => {
                let mut texts = vec![t];
                while let Some(t) = seq.next_element::<String>()? {
                    if texts.len() == MAX_MESSAGES {
                        return Err(de::Error::custom(format!(
                            "more than {MAX_MESSAGES} prompts"
                        )));
                    }
                    texts.push(t);
                }
                Ok(Prompt::Texts(texts))
            }
            First::Id(id) => {
                let mut ids = vec![id];
                more_ids(&mut seq, &mut ids, &mut total)?;
                Ok(Prompt::Tokens(ids))
            }
            First::Ids(ids) => {
                let mut lists = vec![ids];
                while let Some(ids) = seq.next_element_seed(IdList(&mut total))? {
                    if lists.len() == MAX_MESSAGES {
                        return Err(de::Error::custom(format!(
                            "more than {MAX_MESSAGES} prompts"
                        )));
                    }
                    lists.push(ids);
                }
                Ok(Prompt::TokenLists(lists))
            }
        }
    }
}

impl<'de> Deserialize<'de> for Prompt {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(PromptVisitor)
    }
}

struct ContentVisitor;

impl<'de> Visitor<'de> for ContentVisitor {
    type Value = Content;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string or a list of content parts")
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Content, E> {
        Ok(Content::Text(v.to_owned()))
    }
    fn visit_string<E: de::Error>(self, v: String) -> Result<Content, E> {
        Ok(Content::Text(v))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Content, A::Error> {
        capped_seq::<A, ContentPart>(seq, MAX_PARTS, "content parts").map(Content::Parts)
    }
}

impl<'de> Deserialize<'de> for Content {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ContentVisitor)
    }
}

/// A list of at most [`MAX_MESSAGES`] items (chat messages), or null.
pub(super) fn capped_list<'de, D, T>(d: D) -> Result<Option<Vec<T>>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    struct List<T>(std::marker::PhantomData<T>);
    impl<'de, T: Deserialize<'de>> Visitor<'de> for List<T> {
        type Value = Option<Vec<T>>;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a list of messages")
        }
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
            capped_seq(seq, MAX_MESSAGES, "messages").map(Some)
        }
    }
    d.deserialize_any(List(std::marker::PhantomData))
}

/// A list of at most `MAX_MESSAGES` raw items (Anthropic blocks, Responses input items), each
/// kept as its own JSON text: rendered by reading a few fields of each, never as a tree.
pub(super) fn raw_items<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Box<RawValue>>, D::Error> {
    struct Items;
    impl<'de> Visitor<'de> for Items {
        type Value = Vec<Box<RawValue>>;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a list")
        }
        fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
            capped_seq(seq, MAX_MESSAGES, "items")
        }
    }
    d.deserialize_seq(Items)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fields of a body these shapes parse (as `prompt::RoutingFields` has them).
    #[derive(Deserialize)]
    struct Body {
        #[serde(default)]
        prompt: Option<Prompt>,
        #[serde(default, deserialize_with = "capped_list")]
        #[allow(dead_code)]
        messages: Option<Vec<Message>>,
    }

    #[derive(Deserialize)]
    struct Message {
        #[serde(default)]
        #[allow(dead_code)]
        content: Option<Content>,
    }

    fn parse(body: &[u8]) -> Result<Body, serde_json::Error> {
        serde_json::from_slice(body)
    }

    fn prompt(body: &str) -> Result<Option<Prompt>, String> {
        parse(body.as_bytes())
            .map(|f| f.prompt)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn every_prompt_shape_without_buffering() {
        assert!(matches!(prompt(r#"{"prompt":"a"}"#), Ok(Some(Prompt::Text(t))) if t == "a"));
        assert!(
            matches!(prompt(r#"{"prompt":["a","b"]}"#), Ok(Some(Prompt::Texts(t))) if t.len() == 2)
        );
        assert!(
            matches!(prompt(r#"{"prompt":[1,2]}"#), Ok(Some(Prompt::Tokens(t))) if t == [1, 2])
        );
        assert!(
            matches!(prompt(r#"{"prompt":[[1],[2,3]]}"#), Ok(Some(Prompt::TokenLists(t))) if t.len() == 2)
        );
        assert!(matches!(prompt(r#"{"prompt":[]}"#), Ok(Some(Prompt::Tokens(t))) if t.is_empty()));
        assert!(matches!(prompt(r#"{"prompt":null}"#), Ok(None)));
    }

    #[test]
    fn mixed_or_wrong_shapes_are_errors_not_guesses() {
        for bad in [
            r#"{"prompt":["a",1]}"#,
            r#"{"prompt":[1,"a"]}"#,
            r#"{"prompt":[[1],"a"]}"#,
            r#"{"prompt":[-1]}"#,
            r#"{"prompt":[4294967296]}"#,
            r#"{"prompt":{"a":1}}"#,
            r#"{"prompt":7}"#,
        ] {
            assert!(prompt(bad).is_err(), "{bad} parsed");
        }
    }

    #[test]
    fn token_ids_are_capped_across_lists() {
        let over = MAX_PROMPT_TOKENS / 2 + 1;
        let list = format!("[{}0]", "0,".repeat(over - 1));
        let err = prompt(&format!(r#"{{"prompt":[{list},{list}]}}"#)).unwrap_err();
        assert!(err.contains("token ids"), "{err}");
        let ok = format!("[{}0]", "0,".repeat(MAX_PROMPT_TOKENS / 2 - 1));
        assert!(prompt(&format!(r#"{{"prompt":[{ok},{ok}]}}"#)).is_ok());
    }

    #[test]
    fn messages_and_parts_are_capped() {
        let many = vec!["{}"; MAX_MESSAGES + 1].join(",");
        let body = format!(r#"{{"messages":[{many}]}}"#);
        assert!(parse(body.as_bytes()).is_err());
        let parts = vec![r#"{"type":"text","text":""}"#; MAX_PARTS + 1].join(",");
        let body = format!(r#"{{"messages":[{{"role":"user","content":[{parts}]}}]}}"#);
        assert!(parse(body.as_bytes()).is_err());
        assert!(parse(br#"{"messages":null,"prompt":"x"}"#).is_ok());
    }
}
