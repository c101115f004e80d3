//! API keys: `wsk-<id>-<secret>`, where `id` (12 hex digits) is the public lookup id stored in
//! clear and the whole key is stored only as HMAC-SHA256 under a server secret. Verification
//! recomputes the MAC and compares in constant time.

use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

pub const PREFIX: &str = "wsk-";
const ID_HEX: usize = 12;

pub fn random_hex(bytes: usize) -> String {
    let mut b = vec![0u8; bytes];
    rand::rng().fill_bytes(&mut b);
    hex(&b)
}

pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A new key: (public id, the full key to hand out once).
pub fn generate() -> (String, String) {
    let id = random_hex(ID_HEX / 2);
    let key = format!("{PREFIX}{id}-{}", random_hex(32));
    (id, key)
}

/// The public id of a well-formed key.
pub fn key_id(key: &str) -> Option<&str> {
    let rest = key.strip_prefix(PREFIX)?;
    let (id, secret) = rest.split_once('-')?;
    (id.len() == ID_HEX && id.bytes().all(|c| c.is_ascii_hexdigit()) && !secret.is_empty()).then_some(id)
}

pub fn hash(secret: &[u8], key: &str) -> Vec<u8> {
    let mut mac = HmacSha256::new_from_slice(secret).expect("HMAC takes any key length");
    mac.update(key.as_bytes());
    mac.finalize().into_bytes().to_vec()
}

/// Constant-time check of `key` against a stored MAC.
pub fn verify(secret: &[u8], key: &str, stored: &[u8]) -> bool {
    let mut mac = HmacSha256::new_from_slice(secret).expect("HMAC takes any key length");
    mac.update(key.as_bytes());
    mac.verify_slice(stored).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip_and_wrong_ones_fail() {
        let (id, key) = generate();
        assert_eq!(key_id(&key), Some(id.as_str()));
        let h = hash(b"secret", &key);
        assert_eq!(h.len(), 32);
        assert!(!hex(&h).contains(&key[PREFIX.len()..]));
        assert!(verify(b"secret", &key, &h));
        assert!(!verify(b"other secret", &key, &h));
        let mut wrong = key.clone();
        wrong.pop();
        wrong.push(if key.ends_with('0') { '1' } else { '0' });
        assert!(!verify(b"secret", &wrong, &h));
        assert!(!verify(b"secret", &key, &h[..31]));
        let (id2, key2) = generate();
        assert_ne!((id.as_str(), key.as_str()), (id2.as_str(), key2.as_str()));
    }

    #[test]
    fn malformed_keys_have_no_id() {
        assert_eq!(key_id("sk-abc"), None);
        assert_eq!(key_id("wsk-0123456789ab"), None);
        assert_eq!(key_id("wsk-0123456789ab-"), None);
        assert_eq!(key_id("wsk-0123456789zz-xyz"), None);
        assert_eq!(key_id("wsk-0123456789ab-xyz"), Some("0123456789ab"));
    }
}
