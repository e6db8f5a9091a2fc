//! The one tokenization every kvmesh component uses for text (replica, router, bench, simulator).
//!
//! Real engines tokenize with the model's tokenizer, which a router cannot always reproduce. The
//! simulated fleet instead uses a trivial, documented rule so that every party agrees on token ids
//! without a vocabulary: **one token per 4 bytes of UTF-8**, the id being the little-endian `u32`
//! of those bytes, the last chunk zero-padded. It keeps the property that matters for prefix
//! caching: two texts sharing a byte prefix share the token prefix (up to the last whole chunk).

/// A token id, as carried by requests and by vLLM's `BlockStored.token_ids`.
pub type TokenId = u32;

/// Bytes of text per token under the simulator's tokenization.
pub const BYTES_PER_TOKEN: usize = 4;

/// Tokenizes `text` deterministically: one token per 4 bytes (see the module docs).
pub fn tokenize(text: &str) -> Vec<TokenId> {
    text.as_bytes()
        .chunks(BYTES_PER_TOKEN)
        .map(|chunk| {
            let mut word = [0u8; BYTES_PER_TOKEN];
            word[..chunk.len()].copy_from_slice(chunk);
            u32::from_le_bytes(word)
        })
        .collect()
}

/// Number of tokens `text` has under [`tokenize`], without allocating.
pub fn count_tokens(text: &str) -> usize {
    text.len().div_ceil(BYTES_PER_TOKEN)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn four_bytes_per_token_and_padding() {
        assert_eq!(tokenize(""), Vec::<u32>::new());
        assert_eq!(tokenize("abcd"), vec![u32::from_le_bytes(*b"abcd")]);
        assert_eq!(
            tokenize("abcdef"),
            vec![
                u32::from_le_bytes(*b"abcd"),
                u32::from_le_bytes([b'e', b'f', 0, 0])
            ]
        );
        assert_eq!(count_tokens("abcdefghi"), 3);
    }

    #[test]
    fn shared_text_prefix_gives_shared_token_prefix() {
        let a = tokenize("You are a helpful assistant. Question one?");
        let b = tokenize("You are a helpful assistant. Another question entirely");
        assert_eq!(a[..7], b[..7]);
        assert_ne!(a[7], b[7]);
    }
}
