//! The JSON number grammar, byte by byte, shared by the JSON-object and JSON-schema matchers.

/// How far into a number the bytes so far are.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NumState {
    Minus,
    Zero,
    Int,
    Dot,
    Frac,
    Exp,
    ExpSign,
    ExpDigits,
}

impl NumState {
    /// The state after a number's first byte, if `b` can start one.
    pub fn start(b: u8) -> Option<Self> {
        match b {
            b'-' => Some(Self::Minus),
            b'0' => Some(Self::Zero),
            b'1'..=b'9' => Some(Self::Int),
            _ => None,
        }
    }

    /// Whether the number may end here.
    pub fn can_end(self) -> bool {
        matches!(self, Self::Zero | Self::Int | Self::Frac | Self::ExpDigits)
    }

    /// The state after `b`, if `b` continues the number (`integer`: no fraction or exponent).
    pub fn next(self, b: u8, integer: bool) -> Option<Self> {
        use NumState::*;
        let digit = b.is_ascii_digit();
        Some(match (self, b) {
            (Minus, b'0') => Zero,
            (Minus, _) if digit => Int,
            (Int, _) if digit => Int,
            (Zero | Int, b'.') if !integer => Dot,
            (Zero | Int | Frac, b'e' | b'E') if !integer => Exp,
            (Dot | Frac, _) if digit => Frac,
            (Exp, b'+' | b'-') => ExpSign,
            (Exp | ExpSign | ExpDigits, _) if digit => ExpDigits,
            _ => return None,
        })
    }
}
