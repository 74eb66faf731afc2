//! Attention page layouts: the engine's KV-cache layout name and the order of (head, token) cells in a page
//! it implies. The page order is a planner fact: it decides which byte range of a page is a head range or a
//! token range, so it is read off the tensors where they exist (`torch_adapter.py`, the vLLM layout code) and
//! declared only where none does; a declaration the tensors contradict is refused.

use serde::{Deserialize, Serialize};

use super::error::LayoutError;

/// Order of the (head, token) cells inside one attention page (a cell is a token's K then V of one head).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub enum PageOrder {
    /// Heads-major (`[heads, tokens, cell]`): a head range is one contiguous byte range.
    #[default]
    #[serde(rename = "HND")]
    HeadsMajor,
    /// Token-major (`[tokens, heads, cell]`): a token range is one contiguous byte range.
    #[serde(rename = "NHD")]
    TokenMajor,
    /// Heads-major with each head's K stored transposed: a head's page is its K as `[head_size, tokens]` then its
    /// V as `[tokens, head_size]` (vLLM's CPU attention with its `vec`/`vec16` kernels). A head range is one byte
    /// range; a token range of one head is `head_size` K runs (one per K element) and one V run.
    #[serde(rename = "HKTV")]
    HeadsMajorKTransposed,
}

impl PageOrder {
    /// The short name (`HND` or `NHD`).
    pub fn name(self) -> &'static str {
        match self {
            PageOrder::HeadsMajor => "HND",
            PageOrder::TokenMajor => "NHD",
            PageOrder::HeadsMajorKTransposed => "HKTV",
        }
    }

    /// Whether a head range of a page is one contiguous byte range (heads outermost).
    pub fn heads_outermost(self) -> bool {
        self != PageOrder::TokenMajor
    }

    /// Whether a tensor showing `shown` may hold pages of this order: the same order, or heads-major for
    /// [`PageOrder::HeadsMajorKTransposed`] (a tensor's strides show heads before tokens, never the order of the
    /// elements inside a head's page).
    pub fn is_shown_as(self, shown: PageOrder) -> bool {
        self == shown || (self == PageOrder::HeadsMajorKTransposed && shown == PageOrder::HeadsMajor)
    }
}

/// Every KV-cache layout name an engine may give: FlashInfer's `NHD`/`HND`, vLLM's five-letter stride orders
/// of `[L, B, H, N, C]` (layers, blocks, heads, tokens, cell), and `HKTV` (heads-major with K transposed, vLLM's
/// CPU attention). The first [`CONTIGUOUS_LAYOUTS`] keep a block's page in one byte range.
pub const KV_LAYOUTS: [&str; 9] = [
    "HND", "NHD", "LBHNC", "LBNHC", "BLHNC", "BLNHC", "HKTV", "LHBNC", "BHLNC",
];

/// How many of [`KV_LAYOUTS`] (the first) keep a block's page in one byte range.
pub const CONTIGUOUS_LAYOUTS: usize = 7;

/// The page order a KV-cache layout name gives: `Ok(None)` for a known layout whose pages are not one
/// contiguous byte range per block (`LHBNC`, `BHLNC`: heads outside blocks or layers), which a descriptor
/// cannot address whole.
///
/// # Errors
/// The name is not one of [`KV_LAYOUTS`] (the message names it and lists them).
pub fn page_order_of(name: &str) -> Result<Option<PageOrder>, String> {
    match name {
        "HND" | "LBHNC" | "BLHNC" => Ok(Some(PageOrder::HeadsMajor)),
        "NHD" | "LBNHC" | "BLNHC" => Ok(Some(PageOrder::TokenMajor)),
        "HKTV" => Ok(Some(PageOrder::HeadsMajorKTransposed)),
        "LHBNC" | "BHLNC" => Ok(None),
        other => Err(format!(
            "unknown KV-cache layout {other:?}; expected one of {KV_LAYOUTS:?}"
        )),
    }
}

/// A layer's page order as its layout says it: `None` where neither the layer's tensor nor the layout names one.
pub struct LayerOrder<'a> {
    /// Layer name.
    pub name: &'a str,
    /// The page order the layer's memory shows (`LayerMemory::page_layout`).
    pub order: Option<PageOrder>,
}

/// The page order of a rank's attention pages: what every attention layer's tensor shows and the rank's declared
/// `kv_layout` agree on; heads-major (the byte-layout contract, docs/byte-layouts.md) when none says.
///
/// # Errors
/// `PageLayout` naming the layer and both orders when a layer's tensor contradicts the declaration or another
/// layer, an unknown `kv_layout` name, or a declared layout whose pages are not contiguous.
pub fn rank_page_order(declared: Option<&str>, layers: &[LayerOrder<'_>]) -> Result<PageOrder, LayoutError> {
    let declared = match declared {
        None => None,
        Some(name) => match page_order_of(name) {
            Ok(Some(order)) => Some((order, format!("kv_layout {name:?}"))),
            Ok(None) => {
                return Err(LayoutError::PageLayout(format!(
                    "kv_layout {name:?} keeps a block's heads apart (not one contiguous page per block); hybrid-kv \
                     addresses pages whole: use a layout whose L and B axes are outermost"
                )))
            }
            Err(e) => return Err(LayoutError::PageLayout(format!("kv_layout: {e}"))),
        },
    };
    let mut seen = declared;
    for l in layers {
        let Some(order) = l.order else { continue };
        match &seen {
            // a layer may say more than the declaration (HKTV where it says heads-major), never otherwise
            Some((o, _)) if order.is_shown_as(*o) && order != *o => {
                seen = Some((order, format!("layer {}'s tensor", l.name)));
            }
            Some((o, who)) if !o.is_shown_as(order) => {
                return Err(LayoutError::PageLayout(format!(
                    "layer {}: its tensor stores {} pages ({}), but {who} says {} ({})",
                    l.name,
                    describe(order),
                    order.name(),
                    describe(*o),
                    o.name()
                )))
            }
            Some(_) => {}
            None => seen = Some((order, format!("layer {}'s tensor", l.name))),
        }
    }
    Ok(seen.map_or(PageOrder::HeadsMajor, |(o, _)| o))
}

fn describe(o: PageOrder) -> &'static str {
    match o {
        PageOrder::HeadsMajor => "heads-major",
        PageOrder::TokenMajor => "token-major",
        PageOrder::HeadsMajorKTransposed => "heads-major with K transposed",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_to_page_orders() {
        assert_eq!(page_order_of("LBHNC"), Ok(Some(PageOrder::HeadsMajor)));
        assert_eq!(page_order_of("BLNHC"), Ok(Some(PageOrder::TokenMajor)));
        assert_eq!(page_order_of("LHBNC"), Ok(None));
        assert_eq!(page_order_of("HKTV"), Ok(Some(PageOrder::HeadsMajorKTransposed)));
        for (i, name) in KV_LAYOUTS.iter().enumerate() {
            assert_eq!(page_order_of(name).unwrap().is_some(), i < CONTIGUOUS_LAYOUTS, "{name}");
        }
        let err = page_order_of("XYZ").unwrap_err();
        assert!(err.starts_with("unknown KV-cache layout \"XYZ\""), "{err}");
    }

    #[test]
    fn a_declaration_the_tensors_contradict_is_refused() {
        let nhd = [LayerOrder {
            name: "l.0",
            order: Some(PageOrder::TokenMajor),
        }];
        let err = rank_page_order(Some("HND"), &nhd).unwrap_err().to_string();
        assert_eq!(
            err,
            "layer l.0: its tensor stores token-major pages (NHD), but kv_layout \"HND\" says heads-major (HND)"
        );
        assert_eq!(rank_page_order(Some("LBNHC"), &nhd), Ok(PageOrder::TokenMajor));
        assert_eq!(rank_page_order(None, &nhd), Ok(PageOrder::TokenMajor));
        assert_eq!(rank_page_order(None, &[]), Ok(PageOrder::HeadsMajor));
        assert!(rank_page_order(Some("XYZ"), &[]).is_err());
        assert!(rank_page_order(Some("BHLNC"), &[]).is_err());
        let mixed = [
            LayerOrder {
                name: "a",
                order: Some(PageOrder::HeadsMajor),
            },
            LayerOrder {
                name: "b",
                order: Some(PageOrder::TokenMajor),
            },
        ];
        let err = rank_page_order(None, &mixed).unwrap_err().to_string();
        assert!(err.starts_with("layer b: its tensor stores token-major"), "{err}");
    }

    /// Tensors show heads before tokens, never the order inside a head's page: `HKTV` declared over heads-major
    /// tensors is the rank's order; over token-major ones it is refused.
    #[test]
    fn k_transposed_pages_refine_what_heads_major_tensors_show() {
        let layer = |order| {
            [LayerOrder {
                name: "l.0",
                order: Some(order),
            }]
        };
        let hktv = PageOrder::HeadsMajorKTransposed;
        assert_eq!(rank_page_order(Some("HKTV"), &layer(PageOrder::HeadsMajor)), Ok(hktv));
        assert_eq!(rank_page_order(Some("HKTV"), &[]), Ok(hktv));
        assert_eq!(rank_page_order(Some("LBHNC"), &layer(hktv)), Ok(hktv));
        let err = rank_page_order(Some("HKTV"), &layer(PageOrder::TokenMajor))
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "layer l.0: its tensor stores token-major pages (NHD), but kv_layout \"HKTV\" says heads-major with K \
             transposed (HKTV)"
        );
        let err = rank_page_order(Some("NHD"), &layer(hktv)).unwrap_err().to_string();
        assert!(err.contains("K transposed pages (HKTV)"), "{err}");
    }
}
