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
}

impl PageOrder {
    /// The short name (`HND` or `NHD`).
    pub fn name(self) -> &'static str {
        match self {
            PageOrder::HeadsMajor => "HND",
            PageOrder::TokenMajor => "NHD",
        }
    }
}

/// Every KV-cache layout name an engine may give: FlashInfer's `NHD`/`HND` and vLLM's five-letter stride orders
/// of `[L, B, H, N, C]` (layers, blocks, heads, tokens, cell).
pub const KV_LAYOUTS: [&str; 8] = ["HND", "NHD", "LBHNC", "LBNHC", "BLHNC", "BLNHC", "LHBNC", "BHLNC"];

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
            Some((o, who)) if *o != order => {
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
}
