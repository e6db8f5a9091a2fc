//! vLLM's pooling endpoints on the simulated replica: `POST /v1/embeddings` (OpenAI's shape),
//! `POST /rerank`, `/v1/rerank`, `/v2/rerank` (vLLM's Jina/Cohere-style shape) and `POST /score`,
//! `/v1/score` (vLLM's shape). The replica models no pooling head: what matters to a router is
//! the load, so every input (or query–document pair) runs through the engine as a prefill with
//! one output token, and the answer holds deterministic numbers derived from a hash of the text.
//! Pure functions, like `openai.rs`; inputs are capped at [`MAX_ITEMS`].

use base64::Engine as _;
use serde_json::{json, Value};
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::engine_sim::{tokenize, TokenId};

use super::openai::ApiError;

/// Most inputs, documents or pairs one request may carry (each is an engine request).
pub const MAX_ITEMS: usize = 2048;
/// Largest `dimensions` an embedding request may ask for.
pub const MAX_DIMENSIONS: usize = 4096;
/// Embedding length when a request names none.
pub const DEFAULT_DIMENSIONS: usize = 32;

/// Which pooling API a request came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pool {
    /// `/v1/embeddings`
    Embeddings,
    /// `/rerank`, `/v1/rerank`, `/v2/rerank`
    Rerank,
    /// `/score`, `/v1/score`
    Score,
}

impl Pool {
    /// The prefix of its answers' ids.
    pub fn id_prefix(self) -> &'static str {
        match self {
            Pool::Embeddings => "embd",
            Pool::Rerank => "rerank",
            Pool::Score => "score",
        }
    }

    /// The request field an engine refusal (empty or too long an input) names.
    pub fn param(self) -> &'static str {
        match self {
            Pool::Embeddings => "input",
            Pool::Rerank => "documents",
            Pool::Score => "text_2",
        }
    }
}

/// One embedding input: text or token ids.
#[derive(Debug, Clone, PartialEq)]
pub enum Item {
    /// Text, tokenized by the replica's rule.
    Text(String),
    /// Token ids, used as they are.
    Ids(Vec<TokenId>),
}

impl Item {
    fn prompt(&self) -> Vec<TokenId> {
        match self {
            Item::Text(s) => tokenize(s),
            Item::Ids(ids) => ids.clone(),
        }
    }

    fn bytes(&self) -> Vec<u8> {
        match self {
            Item::Text(s) => s.as_bytes().to_vec(),
            Item::Ids(ids) => ids.iter().flat_map(|i| i.to_le_bytes()).collect(),
        }
    }
}

/// A parsed pooling request.
#[derive(Debug, Clone, PartialEq)]
pub enum PoolRequest {
    /// Embeddings of each item.
    Embeddings {
        /// The inputs.
        items: Vec<Item>,
        /// Vector length.
        dimensions: usize,
        /// `encoding_format: "base64"` (little-endian f32s), as the `openai` client asks by
        /// default.
        base64: bool,
    },
    /// Documents ranked against a query.
    Rerank {
        /// The query.
        query: String,
        /// The documents' texts.
        documents: Vec<String>,
        /// How many results to return (all when 0).
        top_n: usize,
    },
    /// Scores of text pairs.
    Score {
        /// (`text_1`, `text_2`) pairs.
        pairs: Vec<(String, String)>,
    },
}

fn bad(message: impl Into<String>, param: &'static str) -> ApiError {
    ApiError::bad_request(message, Some(param))
}

fn capped<T>(items: Vec<T>, param: &'static str) -> Result<Vec<T>, ApiError> {
    if items.is_empty() {
        return Err(bad(format!("'{param}' must not be empty"), param));
    }
    if items.len() > MAX_ITEMS {
        return Err(bad(
            format!("'{param}' has more than {MAX_ITEMS} items"),
            param,
        ));
    }
    Ok(items)
}

fn ids(v: &[Value]) -> Option<Vec<TokenId>> {
    v.iter()
        .map(|t| t.as_u64().and_then(|n| TokenId::try_from(n).ok()))
        .collect()
}

/// `input`: a string, a list of strings, a list of token ids or a list of token-id lists.
fn embedding_items(input: Option<&Value>) -> Result<Vec<Item>, ApiError> {
    let bad_input = || {
        bad(
            "'input' must be a string, a list of strings, a list of token ids or a list of \
             token-id lists",
            "input",
        )
    };
    let items = match input {
        Some(Value::String(s)) => vec![Item::Text(s.clone())],
        Some(Value::Array(list)) if list.iter().all(Value::is_string) => list
            .iter()
            .filter_map(Value::as_str)
            .map(|s| Item::Text(s.to_owned()))
            .collect(),
        Some(Value::Array(list)) if !list.is_empty() && list.iter().all(Value::is_number) => {
            vec![Item::Ids(ids(list).ok_or_else(bad_input)?)]
        }
        Some(Value::Array(list)) => list
            .iter()
            .map(|l| l.as_array().and_then(|l| ids(l)).map(Item::Ids))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(bad_input)?,
        _ => return Err(bad_input()),
    };
    capped(items, "input")
}

fn parse_embeddings(body: &Value) -> Result<PoolRequest, ApiError> {
    let items = embedding_items(body.get("input"))?;
    let dimensions = match body.get("dimensions").filter(|v| !v.is_null()) {
        None => DEFAULT_DIMENSIONS,
        Some(v) => v
            .as_u64()
            .and_then(|n| usize::try_from(n).ok())
            .filter(|n| (1..=MAX_DIMENSIONS).contains(n))
            .ok_or_else(|| {
                bad(
                    format!("'dimensions' must be an integer in 1..={MAX_DIMENSIONS}"),
                    "dimensions",
                )
            })?,
    };
    let base64 = match body.get("encoding_format").filter(|v| !v.is_null()) {
        None => false,
        Some(v) if v == "float" => false,
        Some(v) if v == "base64" => true,
        Some(_) => {
            return Err(bad(
                "'encoding_format' must be \"float\" or \"base64\"",
                "encoding_format",
            ))
        }
    };
    Ok(PoolRequest::Embeddings {
        items,
        dimensions,
        base64,
    })
}

/// A text field that is a string or a list of strings.
fn texts(v: Option<&Value>, param: &'static str) -> Result<Vec<String>, ApiError> {
    let bad_texts = || {
        bad(
            format!("'{param}' must be a string or a list of strings"),
            param,
        )
    };
    match v {
        Some(Value::String(s)) => Ok(vec![s.clone()]),
        Some(Value::Array(list)) => list
            .iter()
            .map(|d| {
                d.as_str()
                    // Jina's and Cohere's document objects.
                    .or_else(|| d.get("text").and_then(Value::as_str))
                    .map(str::to_owned)
            })
            .collect::<Option<Vec<_>>>()
            .ok_or_else(bad_texts),
        _ => Err(bad_texts()),
    }
}

fn parse_rerank(body: &Value) -> Result<PoolRequest, ApiError> {
    let query = body
        .get("query")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("'query' is required: a string", "query"))?
        .to_owned();
    let documents = capped(texts(body.get("documents"), "documents")?, "documents")?;
    let top_n = match body.get("top_n").filter(|v| !v.is_null()) {
        None => 0,
        Some(v) => v
            .as_u64()
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(|| bad("'top_n' must be a non-negative integer", "top_n"))?,
    };
    Ok(PoolRequest::Rerank {
        query,
        documents,
        top_n,
    })
}

fn parse_score(body: &Value) -> Result<PoolRequest, ApiError> {
    let first = capped(texts(body.get("text_1"), "text_1")?, "text_1")?;
    let second = capped(texts(body.get("text_2"), "text_2")?, "text_2")?;
    let pairs = match first.as_slice() {
        // One text_1 is scored against every text_2, as vLLM does.
        [one] => second.into_iter().map(|b| (one.clone(), b)).collect(),
        _ if first.len() == second.len() => first.into_iter().zip(second).collect(),
        _ => {
            return Err(bad(
                "'text_1' must have one item or as many as 'text_2'",
                "text_1",
            ))
        }
    };
    Ok(PoolRequest::Score { pairs })
}

/// Parses a body of `pool`.
pub fn parse(pool: Pool, body: &Value) -> Result<PoolRequest, ApiError> {
    if !body.is_object() {
        return Err(ApiError::bad_request(
            "the request body must be a JSON object",
            None,
        ));
    }
    if body
        .get("model")
        .is_some_and(|m| !m.is_null() && !m.is_string())
    {
        return Err(bad("'model' must be a string", "model"));
    }
    match pool {
        Pool::Embeddings => parse_embeddings(body),
        Pool::Rerank => parse_rerank(body),
        Pool::Score => parse_score(body),
    }
}

/// The text a cross-encoder reads for a pair: the query first, so a query's documents share
/// its prefix, as they do in a real reranker's batch.
fn pair_text(a: &str, b: &str) -> String {
    format!("{a}\n{b}")
}

/// A deterministic unit vector of `dims` from `bytes`' hashes.
pub fn embedding(bytes: &[u8], dims: usize) -> Vec<f32> {
    let raw: Vec<f64> = (0..dims as u64)
        .map(|d| {
            let unit = (xxh3_64_with_seed(bytes, d) >> 11) as f64 / (1u64 << 53) as f64;
            unit * 2.0 - 1.0
        })
        .collect();
    let norm = raw
        .iter()
        .map(|x| x * x)
        .sum::<f64>()
        .sqrt()
        .max(f64::MIN_POSITIVE);
    raw.iter().map(|x| (x / norm) as f32).collect()
}

/// A deterministic relevance in [0, 1) for a pair.
pub fn relevance(a: &str, b: &str) -> f64 {
    let h = xxh3_64_with_seed(pair_text(a, b).as_bytes(), 0x5c0e);
    (h >> 11) as f64 / (1u64 << 53) as f64
}

impl PoolRequest {
    /// The engine prompts, one per input, document or pair.
    pub fn prompts(&self) -> Vec<Vec<TokenId>> {
        match self {
            PoolRequest::Embeddings { items, .. } => items.iter().map(Item::prompt).collect(),
            PoolRequest::Rerank {
                query, documents, ..
            } => documents
                .iter()
                .map(|d| tokenize(&pair_text(query, d)))
                .collect(),
            PoolRequest::Score { pairs } => pairs
                .iter()
                .map(|(a, b)| tokenize(&pair_text(a, b)))
                .collect(),
        }
    }

    /// The answer, given each prompt's token count (in [`PoolRequest::prompts`]' order).
    pub fn answer(&self, id: &str, created: u64, model: &str, prompt_tokens: &[usize]) -> Value {
        let total: usize = prompt_tokens.iter().sum();
        let usage = json!({"prompt_tokens": total, "total_tokens": total,
                           "completion_tokens": 0, "prompt_tokens_details": null});
        match self {
            PoolRequest::Embeddings {
                items,
                dimensions,
                base64,
            } => {
                let data: Vec<Value> = items
                    .iter()
                    .enumerate()
                    .map(|(index, item)| {
                        let v = embedding(&item.bytes(), *dimensions);
                        let embedding = if *base64 {
                            let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                            json!(base64::engine::general_purpose::STANDARD.encode(bytes))
                        } else {
                            json!(v)
                        };
                        json!({"object": "embedding", "index": index, "embedding": embedding})
                    })
                    .collect();
                json!({"id": id, "object": "list", "created": created, "model": model,
                       "data": data, "usage": usage})
            }
            PoolRequest::Rerank {
                query,
                documents,
                top_n,
            } => {
                let mut results: Vec<(usize, f64)> = documents
                    .iter()
                    .enumerate()
                    .map(|(i, d)| (i, relevance(query, d)))
                    .collect();
                results.sort_by(|a, b| b.1.total_cmp(&a.1));
                if *top_n > 0 {
                    results.truncate(*top_n);
                }
                let results: Vec<Value> = results
                    .into_iter()
                    .map(|(index, score)| {
                        let text = documents.get(index).map_or("", String::as_str);
                        json!({"index": index, "document": {"text": text},
                               "relevance_score": score})
                    })
                    .collect();
                json!({"id": id, "model": model, "results": results,
                       "usage": {"prompt_tokens": total, "total_tokens": total}})
            }
            PoolRequest::Score { pairs } => {
                let data: Vec<Value> = pairs
                    .iter()
                    .enumerate()
                    .map(|(index, (a, b))| {
                        json!({"index": index, "object": "score", "score": relevance(a, b)})
                    })
                    .collect();
                json!({"id": id, "object": "list", "created": created, "model": model,
                       "data": data, "usage": usage})
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedding_inputs_and_answer() {
        let forms = [
            (json!("abcdefgh"), 1, vec![2]),
            (json!(["ab", "abcdefghi"]), 2, vec![1, 3]),
            (json!([1, 2, 3]), 1, vec![3]),
            (json!([[1], [2, 3]]), 2, vec![1, 2]),
        ];
        for (input, n, lens) in forms {
            let r = parse(Pool::Embeddings, &json!({"input": input})).unwrap();
            let prompts = r.prompts();
            assert_eq!(prompts.len(), n);
            assert_eq!(prompts.iter().map(Vec::len).collect::<Vec<_>>(), lens);
        }
        let r = parse(
            Pool::Embeddings,
            &json!({"input": ["a", "b"], "dimensions": 8}),
        )
        .unwrap();
        let a = r.answer("embd-r0-1", 5, "sim", &[1, 1]);
        assert_eq!(a["usage"]["prompt_tokens"], 2);
        let v: Vec<f32> = serde_json::from_value(a["data"][0]["embedding"].clone()).unwrap();
        assert_eq!(v.len(), 8);
        let norm: f32 = v.iter().map(|x| x * x).sum();
        assert!((norm - 1.0).abs() < 1e-4);
        assert_ne!(a["data"][0]["embedding"], a["data"][1]["embedding"]);
        assert_eq!(a["data"][1]["index"], 1);
        // Deterministic, and base64 carries the same little-endian f32s.
        let b64 = parse(
            Pool::Embeddings,
            &json!({"input": ["a", "b"], "dimensions": 8, "encoding_format": "base64"}),
        )
        .unwrap()
        .answer("x", 0, "sim", &[1, 1]);
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(b64["data"][0]["embedding"].as_str().unwrap())
            .unwrap();
        let back: Vec<f32> = bytes
            .chunks(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert_eq!(back, v);
    }

    #[test]
    fn rerank_and_score_shapes() {
        let body = json!({"query": "q", "documents": ["d0", {"text": "d1"}, "d2"], "top_n": 2});
        let r = parse(Pool::Rerank, &body).unwrap();
        let prompts = r.prompts();
        assert_eq!(prompts[0], tokenize("q\nd0"));
        let a = r.answer("rerank-r0-1", 0, "sim", &[2, 2, 2]);
        let results = a["results"].as_array().unwrap();
        assert_eq!(results.len(), 2);
        assert!(results[0]["relevance_score"].as_f64() >= results[1]["relevance_score"].as_f64());
        let i = results[0]["index"].as_u64().unwrap() as usize;
        assert_eq!(results[0]["document"]["text"], format!("d{i}"));
        assert_eq!(a["usage"]["total_tokens"], 6);

        let s = parse(Pool::Score, &json!({"text_1": "a", "text_2": ["b", "c"]})).unwrap();
        assert_eq!(s.prompts().len(), 2);
        let a = s.answer("score-r0-2", 0, "sim", &[1, 1]);
        assert_eq!(a["data"][1]["object"], "score");
        assert_eq!(a["data"][1]["score"], relevance("a", "c"));
        let zipped = parse(
            Pool::Score,
            &json!({"text_1": ["a", "b"], "text_2": ["c", "d"]}),
        );
        assert_eq!(zipped.unwrap().prompts()[1], tokenize("b\nd"));
    }

    #[test]
    fn bad_requests_are_400() {
        let too_many: Vec<&str> = vec!["x"; MAX_ITEMS + 1];
        for (pool, body) in [
            (Pool::Embeddings, json!({})),
            (Pool::Embeddings, json!({"input": []})),
            (Pool::Embeddings, json!({"input": ["a", 1]})),
            (Pool::Embeddings, json!({"input": [-1]})),
            (Pool::Embeddings, json!({"input": too_many})),
            (Pool::Embeddings, json!({"input": "a", "dimensions": 0})),
            (
                Pool::Embeddings,
                json!({"input": "a", "encoding_format": "int8"}),
            ),
            (Pool::Embeddings, json!({"input": "a", "model": 1})),
            (Pool::Rerank, json!({"documents": ["a"]})),
            (Pool::Rerank, json!({"query": "q", "documents": []})),
            (Pool::Rerank, json!({"query": "q", "documents": [1]})),
            (Pool::Score, json!({"text_1": ["a", "b"], "text_2": ["c"]})),
            (Pool::Score, json!({"text_1": "a"})),
            (Pool::Score, json!([1])),
        ] {
            assert_eq!(parse(pool, &body).unwrap_err().status, 400, "{body}");
        }
    }
}
