//! The `.npy` header: a magic string, a version, a length, and a Python dict literal giving the
//! element type, the order and the shape. Untrusted input: every length is checked against
//! the file, every product for overflow, and anything numpy does not write is refused.

/// The magic string every `.npy` file starts with.
const MAGIC: &[u8; 6] = b"\x93NUMPY";

/// The longest header read: numpy itself refuses headers past 10,000 bytes unless told
/// otherwise; this leaves room for long shapes and refuses a length meant to exhaust memory.
pub(crate) const MAX_HEADER: u64 = 1 << 20;

/// The element types read, as numpy writes them on a little-endian machine, with the bytes
/// of one.
const DTYPES: [(&str, usize); 12] = [
    ("|b1", 1),
    ("|u1", 1),
    ("|i1", 1),
    ("<u2", 2),
    ("<i2", 2),
    ("<f2", 2),
    ("<u4", 4),
    ("<i4", 4),
    ("<f4", 4),
    ("<u8", 8),
    ("<i8", 8),
    ("<f8", 8),
];

/// Where an array lies in its file and what it holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Layout {
    /// The element type as numpy writes it: `|u1`, `<f4`.
    pub(crate) descr: &'static str,
    /// Bytes of one element.
    pub(crate) item_bytes: usize,
    /// The whole shape; its first axis counts the samples.
    pub(crate) shape: Vec<usize>,
    /// Where the data starts: the header's end.
    pub(crate) data_offset: u64,
    /// Bytes of one sample.
    pub(crate) sample_bytes: usize,
}

impl Layout {
    /// Samples: the first axis.
    pub(crate) fn len(&self) -> usize {
        self.shape[0]
    }

    /// Bytes of the data: every sample.
    #[cfg(test)]
    pub(crate) fn data_bytes(&self) -> u64 {
        // Checked in `parse`: it fits the file.
        self.len() as u64 * self.sample_bytes as u64
    }
}

/// The header's end (where the data starts), from the file's first bytes: the magic, the
/// version and the header's length (10 bytes for version 1, 12 for versions 2 and 3).
///
/// # Errors
///
/// Bytes that are not a `.npy` preamble, a version other than 1.0, 2.0 or 3.0, or a header
/// longer than [`MAX_HEADER`].
pub(crate) fn header_end(head: &[u8]) -> Result<u64, String> {
    if head.len() < 8 || &head[..6] != MAGIC {
        return Err("not a .npy file (no \\x93NUMPY magic string at its start)".into());
    }
    let (start, length) = match (head[6], head[7]) {
        (1, 0) => (
            10,
            head.get(8..10)
                .map(|b| u64::from(u16::from_le_bytes([b[0], b[1]]))),
        ),
        (2 | 3, 0) => (
            12,
            head.get(8..12)
                .map(|b| u64::from(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))),
        ),
        (major, minor) => {
            return Err(format!(
                ".npy format version {major}.{minor}: only 1.0, 2.0 and 3.0 are read"
            ));
        }
    };
    let length = length.ok_or("the file ends inside its .npy preamble")?;
    if length > MAX_HEADER {
        return Err(format!(
            "a header of {length} bytes declared: at most {MAX_HEADER} are read"
        ));
    }
    Ok(start + length)
}

/// The layout described by `head` (the file's bytes up to at least the header's end), in a
/// file of `file_len` bytes.
///
/// # Errors
///
/// Anything but a header numpy writes for a C-ordered little-endian array of a type in
/// [`DTYPES`] with at least one axis, or data that does not fit in `file_len`.
pub(crate) fn parse(head: &[u8], file_len: u64) -> Result<Layout, String> {
    let end = header_end(head)?;
    let start = if head[6] == 1 { 10 } else { 12 };
    if end > file_len {
        return Err(format!(
            "the header runs to byte {end}, past the file's end at {file_len}"
        ));
    }
    let dict = usize::try_from(end)
        .ok()
        .and_then(|end| head.get(start..end))
        .ok_or("the header was not read whole")?;
    let dict = std::str::from_utf8(dict).map_err(|_| "the header is not text")?;
    let header = Dict::parse(dict)?;
    layout(header, end, file_len)
}

/// Checks the dict's values and sizes them against the file.
fn layout(header: Dict, data_offset: u64, file_len: u64) -> Result<Layout, String> {
    if header.fortran_order {
        return Err("'fortran_order': True: only C-ordered arrays are read".into());
    }
    let (descr, item_bytes) = dtype(&header.descr)?;
    let Some((&len, sample_shape)) = header.shape.split_first() else {
        return Err("shape (): a 0-d array has no axis of samples".into());
    };
    let too_large = || format!("shape {:?}: the array's size overflows", header.shape);
    if len > 0 && sample_shape.contains(&0) {
        // Samples of no bytes: a few bytes of file could claim any number of them.
        return Err(format!(
            "shape {:?}: samples of zero elements hold nothing to load",
            header.shape
        ));
    }
    let sample_bytes = sample_shape
        .iter()
        .try_fold(item_bytes, |bytes, &axis| bytes.checked_mul(axis))
        .ok_or_else(too_large)?;
    let data_bytes = (len as u64)
        .checked_mul(sample_bytes as u64)
        .ok_or_else(too_large)?;
    let available = file_len - data_offset;
    if data_bytes > available {
        return Err(format!(
            "shape {:?} of {descr} takes {data_bytes} bytes, but the file holds {available} \
             after its header",
            header.shape
        ));
    }
    Ok(Layout {
        descr,
        item_bytes,
        shape: header.shape,
        data_offset,
        sample_bytes,
    })
}

/// The element type of a descr, as numpy writes it, with its bytes.
fn dtype(descr: &str) -> Result<(&'static str, usize), String> {
    let unknown = || {
        format!(
            "element type '{descr}': only little-endian bool, integers and floats of 1 to 8 \
             bytes are read (b1 u1 i1 u2 i2 f2 u4 i4 f4 u8 i8 f8)"
        )
    };
    let (order, code) = match descr.as_bytes().first() {
        Some(&order @ (b'<' | b'>' | b'|' | b'=')) => (order, &descr[1..]),
        _ => return Err(unknown()),
    };
    let &(name, bytes) = DTYPES
        .iter()
        .find(|(name, _)| &name[1..] == code)
        .ok_or_else(unknown)?;
    match (order, bytes) {
        // Byte order does not apply to single bytes: numpy writes '|', others may not.
        (_, 1) => Ok((name, 1)),
        (b'<', _) if cfg!(target_endian = "little") => Ok((name, bytes)),
        (b'>', _) => Err(format!(
            "element type '{descr}' is big-endian: only little-endian arrays are read \
             (numpy: `a.astype(a.dtype.newbyteorder('<'))`)"
        )),
        _ => Err(unknown()),
    }
}

/// The three entries of a header's dict.
struct Dict {
    descr: String,
    fortran_order: bool,
    shape: Vec<usize>,
}

impl Dict {
    /// Parses `{'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }`: the three keys
    /// once each, in any order, with any spacing, and only whitespace after the closing brace.
    fn parse(text: &str) -> Result<Self, String> {
        let mut cursor = Cursor { rest: text };
        let (mut descr, mut fortran_order, mut shape) = (None, None, None);
        cursor.expect('{')?;
        while !cursor.eat('}') {
            let key = cursor.string()?;
            cursor.expect(':')?;
            let fresh = match key.as_str() {
                "descr" => descr.replace(cursor.string()?).is_none(),
                "fortran_order" => fortran_order.replace(cursor.boolean()?).is_none(),
                "shape" => shape.replace(cursor.tuple()?).is_none(),
                _ => return Err(format!("the header has a key '{key}' numpy does not write")),
            };
            if !fresh {
                return Err(format!("the header gives '{key}' twice"));
            }
            if !cursor.eat(',') {
                cursor.expect('}')?;
                break;
            }
        }
        if !cursor.rest.trim_start().is_empty() {
            return Err("the header has more after its dict".into());
        }
        let missing = |key| format!("the header has no '{key}'");
        Ok(Self {
            descr: descr.ok_or_else(|| missing("descr"))?,
            fortran_order: fortran_order.ok_or_else(|| missing("fortran_order"))?,
            shape: shape.ok_or_else(|| missing("shape"))?,
        })
    }
}

/// A position in the header's text; every step skips whitespace first.
struct Cursor<'a> {
    rest: &'a str,
}

impl Cursor<'_> {
    fn eat(&mut self, c: char) -> bool {
        self.rest = self.rest.trim_start();
        match self.rest.strip_prefix(c) {
            Some(rest) => {
                self.rest = rest;
                true
            }
            None => false,
        }
    }

    fn expect(&mut self, c: char) -> Result<(), String> {
        if self.eat(c) {
            return Ok(());
        }
        let found: String = self.rest.chars().take(12).collect();
        Err(format!(
            "the header's dict wants '{c}' where it has '{found}'"
        ))
    }

    /// A quoted string without escapes (numpy's keys and descrs have none).
    fn string(&mut self) -> Result<String, String> {
        self.rest = self.rest.trim_start();
        let quote = match self.rest.chars().next() {
            Some(q @ ('\'' | '"')) => q,
            _ => return Err("the header's dict wants a quoted string".into()),
        };
        let body = &self.rest[1..];
        let end = body
            .find(quote)
            .ok_or("the header has a string with no closing quote")?;
        if body[..end].contains('\\') {
            return Err("the header has a string with an escape".into());
        }
        self.rest = &body[end + 1..];
        Ok(body[..end].to_owned())
    }

    fn boolean(&mut self) -> Result<bool, String> {
        self.rest = self.rest.trim_start();
        for (word, value) in [("True", true), ("False", false)] {
            if let Some(rest) = self.rest.strip_prefix(word) {
                self.rest = rest;
                return Ok(value);
            }
        }
        Err("'fortran_order' is neither True nor False".into())
    }

    /// A tuple of non-negative integers: `()`, `(3,)`, `(3, 4)`, `(3, 4,)`.
    fn tuple(&mut self) -> Result<Vec<usize>, String> {
        self.expect('(')?;
        let mut axes = Vec::new();
        while !self.eat(')') {
            axes.push(self.integer()?);
            if !self.eat(',') {
                self.expect(')')?;
                break;
            }
        }
        Ok(axes)
    }

    /// A decimal integer, with Python 2's `L` suffix allowed (old numpy wrote `3L`).
    fn integer(&mut self) -> Result<usize, String> {
        self.rest = self.rest.trim_start();
        let digits = self.rest.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return Err("the header's shape holds something other than integers".into());
        }
        let value = self.rest[..digits]
            .parse::<usize>()
            .map_err(|_| format!("the header's shape has an axis of {}", &self.rest[..digits]))?;
        self.rest = &self.rest[digits..];
        self.rest = self.rest.strip_prefix('L').unwrap_or(self.rest);
        Ok(value)
    }
}

#[cfg(test)]
mod tests;
