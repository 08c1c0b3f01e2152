//! The benchmark loaders on real files in a temporary directory.

use std::path::Path;

use base64::Engine as _;
use fleet_judge::benchmark::{
    load_gedit, load_jsonl, load_scorer_json, resize_to_source, Error, ImageRef, SkipKind,
};
use image::{DynamicImage, Rgb, RgbImage};
use serde_json::json;

fn png_bytes(w: u32, h: u32) -> Vec<u8> {
    let img = RgbImage::from_fn(w, h, |x, y| Rgb([(x * 40) as u8, (y * 40) as u8, 128]));
    let mut out = std::io::Cursor::new(Vec::new());
    DynamicImage::ImageRgb8(img)
        .write_to(&mut out, image::ImageOutputFormat::Png)
        .unwrap();
    out.into_inner()
}

fn write_png(path: &Path, w: u32, h: u32) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, png_bytes(w, h)).unwrap();
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

fn scorer_item(subset: &str, path: &str, src_b64: &str) -> serde_json::Value {
    json!({
        "subset": subset,
        "original_description": "原描述",
        "original_description_en": "a red car",
        "edit_instruction": "把车变成蓝色",
        "edit_instruction_en": "make the car blue",
        "src_img_b64": src_b64,
        "rationale_short_en": "physics",
        "tags": ["color"],
        "difficulty": "easy",
        "original_image_path": path,
        "seed": 7
    })
}

#[test]
fn scorer_json_good_path_and_bad_items() {
    let dir = tempfile::tempdir().unwrap();
    let edited = dir.path().join("edited");
    // The scorer's own layout (`<subset>/<pair id>.png`) and `<pair id>.png` directly; the pair
    // id drops the directory and the .png/.jpg of original_image_path.
    write_png(&edited.join("物理").join("p1.png"), 4, 4);
    write_png(&edited.join("p2.png"), 4, 4);
    write_png(&edited.join("p5.png"), 4, 4);
    write_png(&edited.join("p6.png"), 4, 4);
    let good = b64(&png_bytes(4, 4));
    let mut plain_only = scorer_item("环境", "imgs/p2.jpg", &good);
    plain_only
        .as_object_mut()
        .unwrap()
        .remove("edit_instruction_en");
    let items = json!([
        scorer_item(
            "物理",
            "images/p1.png",
            &format!("data:image/png;base64,{good}")
        ),
        plain_only,
        scorer_item("物理", "images/p3.png", &good), // no edited image
        scorer_item("物理", "images/p4.png", "!!!not base64!!!"), // bad base64
        scorer_item("物理", "images/p5.png", &b64(b"hello, not an image")),
        scorer_item("未知", "images/p6.png", &good), // unknown category
    ]);
    let json_path = dir.path().join("bench.json");
    std::fs::write(&json_path, serde_json::to_string(&items).unwrap()).unwrap();

    let cats = ["物理", "环境", "社会", "因果", "指代"];
    let loaded = load_scorer_json(&json_path, &edited, Some(&cats)).unwrap();
    assert_eq!(loaded.items.len(), 2, "{loaded}: {:?}", loaded.skipped);
    let a = &loaded.items[0];
    assert_eq!(a.id, "p1");
    assert_eq!(a.category, "物理");
    assert_eq!(a.instruction, "make the car blue");
    assert_eq!(a.language.as_deref(), Some("en"));
    assert_eq!(a.edited, ImageRef::Path(edited.join("物理").join("p1.png")));
    assert!(matches!(&a.source, ImageRef::Bytes(b) if image::load_from_memory(b).is_ok()));
    assert!(a.source.load().is_ok() && a.edited.load().is_ok());
    assert_eq!(a.extra["description"], "a red car");
    assert_eq!(a.extra["seed"], 7);
    assert!(!a.extra.contains_key("src_img_b64"));
    let b = &loaded.items[1];
    assert_eq!(b.id, "p2");
    assert_eq!(b.instruction, "把车变成蓝色");
    assert_eq!(b.language, None);
    assert_eq!(b.edited, ImageRef::Path(edited.join("p2.png")));

    let kinds: Vec<(String, SkipKind)> = loaded
        .skipped
        .iter()
        .map(|s| (s.id.clone(), s.kind))
        .collect();
    assert_eq!(
        kinds,
        vec![
            ("p3".to_string(), SkipKind::MissingEdited),
            ("p4".to_string(), SkipKind::BadBase64),
            ("p5".to_string(), SkipKind::Base64NotImage),
            ("p6".to_string(), SkipKind::UnknownCategory),
        ]
    );
    assert!(
        loaded.skipped[3].reason.contains("未知"),
        "{}",
        loaded.skipped[3].reason
    );
    assert_eq!(
        loaded.to_string(),
        "2 items loaded, 4 skipped: 1 unknown category, 1 missing edited image, 1 bad base64, \
         1 base64 not an image"
    );

    // Without a category list the unknown subset is accepted.
    let all = load_scorer_json(&json_path, &edited, None).unwrap();
    assert_eq!(all.items.len(), 3);
}

#[test]
fn scorer_json_edited_name_exact_and_not_a_list() {
    let dir = tempfile::tempdir().unwrap();
    let edited = dir.path().join("edited");
    // A pair id without '/' is kept as is, and the file may be named by it exactly.
    write_png(&edited.join("q1.png"), 3, 3);
    let items = json!([scorer_item("社会", "q1.png", &b64(&png_bytes(3, 3)))]);
    let json_path = dir.path().join("bench.json");
    std::fs::write(&json_path, items.to_string()).unwrap();
    let loaded = load_scorer_json(&json_path, &edited, None).unwrap();
    assert_eq!(loaded.items[0].id, "q1.png");
    assert_eq!(
        loaded.items[0].edited,
        ImageRef::Path(edited.join("q1.png"))
    );

    std::fs::write(&json_path, "{\"a\": 1}").unwrap();
    let err = load_scorer_json(&json_path, &edited, None).unwrap_err();
    assert!(matches!(err, Error::NotAList { .. }), "{err}");
}

#[test]
fn all_skipped_is_an_error_with_reasons() {
    let dir = tempfile::tempdir().unwrap();
    let edited = dir.path().join("edited");
    std::fs::create_dir_all(&edited).unwrap();
    let items = json!([scorer_item("物理", "images/x.png", &b64(&png_bytes(2, 2)))]);
    let json_path = dir.path().join("bench.json");
    std::fs::write(&json_path, items.to_string()).unwrap();
    let err = load_scorer_json(&json_path, &edited, None).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, Error::Empty { skipped: 1, .. }), "{msg}");
    assert!(
        msg.contains("x") && msg.contains("no edited image"),
        "{msg}"
    );
}

#[test]
fn gedit_layout_good_path_and_bad_rows() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    let full = model.join("fullset");
    write_png(&full.join("color_alter/en/k1_SRCIMG.png"), 6, 4);
    write_png(&full.join("color_alter/en/k1.png"), 8, 8);
    write_png(&full.join("color_alter/cn/k1_SRCIMG.png"), 6, 4);
    write_png(&full.join("color_alter/cn/k1.png"), 8, 8);
    write_png(&full.join("subject-add/en/k2_SRCIMG.png"), 6, 4); // edit missing
    let rows = [
        json!({"task_type": "color_alter", "key": "k1", "instruction": "make it red",
               "instruction_language": "en", "Intersection_exist": true}),
        json!({"task_type": "color_alter", "key": "k1", "instruction": "变红",
               "instruction_language": "cn", "Intersection_exist": true}),
        json!({"task_type": "subject-add", "key": "k2", "instruction": "add a dog",
               "instruction_language": "en"}),
        json!({"task_type": "dance", "key": "k3", "instruction": "dance",
               "instruction_language": "en"}),
        json!({"task_type": "color_alter", "instruction": "no key", "instruction_language": "en"}),
    ];
    let mut text: String = rows.iter().map(|r| format!("{r}\n")).collect();
    text.push_str("not json\n");
    let rows_path = dir.path().join("rows.jsonl");
    std::fs::write(&rows_path, text).unwrap();

    let en = load_gedit(&model, "en", None, &rows_path).unwrap();
    assert_eq!(en.items.len(), 1, "{en}: {:?}", en.skipped);
    let item = &en.items[0];
    assert_eq!(
        (item.id.as_str(), item.category.as_str()),
        ("k1", "color_alter")
    );
    assert_eq!(item.instruction, "make it red");
    assert_eq!(item.language.as_deref(), Some("en"));
    assert_eq!(
        item.source,
        ImageRef::Path(full.join("color_alter/en/k1_SRCIMG.png"))
    );
    assert_eq!(
        item.edited,
        ImageRef::Path(full.join("color_alter/en/k1.png"))
    );
    assert_eq!(item.extra["Intersection_exist"], true);
    let kinds: Vec<SkipKind> = en.skipped.iter().map(|s| s.kind).collect();
    assert_eq!(
        kinds,
        vec![
            SkipKind::MissingEdited,
            SkipKind::UnknownCategory,
            SkipKind::MissingField,
            SkipKind::NotJson
        ]
    );
    assert_eq!(en.skipped[2].id, "line 5");
    assert!(
        en.skipped[2].reason.contains("key"),
        "{}",
        en.skipped[2].reason
    );
    assert_eq!(en.skipped[3].id, "line 6");

    let cn = load_gedit(&full, "cn", Some(&model), &rows_path).unwrap();
    assert_eq!(cn.items.len(), 1);
    assert_eq!(cn.items[0].instruction, "变红");

    let err = load_gedit(&model, "zh", None, &rows_path).unwrap_err();
    assert!(matches!(err, Error::BadLanguage { .. }), "{err}");

    // The edit is judged at the source's size.
    let src = item.source.load().unwrap();
    let edit = item.edited.load().unwrap();
    let resized = resize_to_source(&edit, &src);
    assert_eq!((resized.width(), resized.height()), (6, 4));
    assert!(matches!(resized, DynamicImage::ImageRgb8(_)));
}

#[test]
fn resize_to_source_gives_source_size() {
    let edit = DynamicImage::ImageRgba8(image::RgbaImage::new(17, 9));
    let src = DynamicImage::ImageRgb8(RgbImage::new(5, 12));
    let out = resize_to_source(&edit, &src);
    assert_eq!((out.width(), out.height()), (5, 12));
    let same = resize_to_source(&src, &src);
    assert_eq!(same.to_rgb8(), src.to_rgb8());
}

#[test]
fn jsonl_good_path_and_bad_lines() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path();
    write_png(&base.join("src/a.png"), 4, 4);
    write_png(&base.join("out/a.png"), 4, 4);
    let abs_src = base.join("src/b.png");
    write_png(&abs_src, 4, 4);
    write_png(&base.join("out/b.png"), 4, 4);
    std::fs::write(base.join("out/broken.png"), b"not a png").unwrap();
    let lines = [
        json!({"id": "a", "category": "color", "instruction": "blue", "source": "src/a.png",
               "edited": "out/a.png", "language": "en", "seed": 3})
        .to_string(),
        json!({"id": "b", "category": "style", "instruction": "sketch",
               "source": abs_src.to_str().unwrap(), "edited": "out/b.png"})
        .to_string(),
        String::new(),
        "{not json".to_string(),
        json!({"id": "c", "category": "color", "source": "src/a.png", "edited": "out/a.png"})
            .to_string(),
        json!({"id": "d", "category": "color", "instruction": "x", "source": "src/a.png",
               "edited": "out/missing.png"})
        .to_string(),
        json!({"id": "e", "category": "color", "instruction": "x", "source": "src/a.png",
               "edited": "out/broken.png"})
        .to_string(),
    ];
    let path = base.join("bench.jsonl");
    std::fs::write(&path, lines.join("\n")).unwrap();
    let loaded = load_jsonl(&path, base).unwrap();
    assert_eq!(loaded.items.len(), 2, "{loaded}: {:?}", loaded.skipped);
    let a = &loaded.items[0];
    assert_eq!(
        (a.id.as_str(), a.category.as_str(), a.instruction.as_str()),
        ("a", "color", "blue")
    );
    assert_eq!(a.source, ImageRef::Path(base.join("src/a.png")));
    assert_eq!(a.language.as_deref(), Some("en"));
    assert_eq!(a.extra["seed"], 3);
    assert_eq!(loaded.items[1].source, ImageRef::Path(abs_src.clone()));
    let got: Vec<(&str, SkipKind)> = loaded
        .skipped
        .iter()
        .map(|s| (s.id.as_str(), s.kind))
        .collect();
    assert_eq!(
        got,
        vec![
            ("line 4", SkipKind::NotJson),
            ("line 5", SkipKind::MissingField),
            ("d", SkipKind::MissingEdited),
            ("e", SkipKind::UnreadableImage),
        ]
    );
    assert!(
        loaded.skipped[1].reason.contains("instruction"),
        "{}",
        loaded.skipped[1].reason
    );
    assert_eq!(
        loaded.to_string(),
        "2 items loaded, 4 skipped: 1 not JSON, 1 missing field, 1 missing edited image, 1 unreadable image"
    );
}

#[test]
fn jsonl_duplicate_id_is_an_error_naming_both_lines() {
    let dir = tempfile::tempdir().unwrap();
    write_png(&dir.path().join("a.png"), 2, 2);
    let line = json!({"id": "a", "category": "c", "instruction": "i", "source": "a.png", "edited": "a.png"});
    let other = json!({"id": "b", "category": "c", "instruction": "i", "source": "a.png", "edited": "a.png"});
    let path = dir.path().join("bench.jsonl");
    std::fs::write(&path, format!("{line}\n{other}\n{line}\n")).unwrap();
    let err = load_jsonl(&path, dir.path()).unwrap_err();
    match &err {
        Error::DuplicateId {
            id,
            first_line,
            second_line,
            ..
        } => {
            assert_eq!((id.as_str(), *first_line, *second_line), ("a", 1, 3));
        }
        other => panic!("expected DuplicateId, got {other}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains("line 1") && msg.contains("line 3") && msg.contains("bench.jsonl"),
        "{msg}"
    );
}

/// Images the judge's processor refuses (one side over 200 times the other) are listed and
/// skipped up front, in files and in the scorer's base64; 200:1 itself is taken.
#[test]
fn extreme_aspect_ratios_are_skipped_with_the_size() {
    let dir = tempfile::tempdir().unwrap();
    write_png(&dir.path().join("ok_src.png"), 4, 4);
    write_png(&dir.path().join("ok_edit.png"), 400, 2); // 200:1, allowed
    write_png(&dir.path().join("thin.png"), 402, 2); // 201:1
    let lines = [
        json!({"id": "a", "category": "c", "instruction": "i", "source": "ok_src.png", "edited": "ok_edit.png"}),
        json!({"id": "b", "category": "c", "instruction": "i", "source": "thin.png", "edited": "ok_edit.png"}),
    ];
    let path = dir.path().join("b.jsonl");
    std::fs::write(
        &path,
        lines.iter().map(|l| format!("{l}\n")).collect::<String>(),
    )
    .unwrap();
    let loaded = load_jsonl(&path, dir.path()).unwrap();
    assert_eq!(loaded.items.len(), 1);
    assert_eq!(loaded.items[0].id, "a");
    assert_eq!(loaded.skipped.len(), 1);
    assert_eq!(loaded.skipped[0].kind, SkipKind::ExtremeAspectRatio);
    assert!(
        loaded.skipped[0].reason.contains("402x2"),
        "{}",
        loaded.skipped[0].reason
    );

    // The scorer's base64 source image.
    let edited = dir.path().join("edited");
    write_png(&edited.join("p1.png"), 4, 4);
    let items = json!([scorer_item("物理", "p1.png", &b64(&png_bytes(1, 300)))]);
    let json_path = dir.path().join("bench.json");
    std::fs::write(&json_path, items.to_string()).unwrap();
    // Its only item skipped: an error that gives the reason.
    let err = load_scorer_json(&json_path, &edited, None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("1x300") && err.contains("200:1"), "{err}");
}

/// A PNG whose header is intact but whose data is cut to 60% of its bytes: the header still
/// reads (so a header-only check passes), the full decode fails.
fn write_truncated_png(path: &Path) {
    let full = png_bytes(64, 64);
    let cut = &full[..full.len() * 6 / 10];
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, cut).unwrap();
    let dims = image::io::Reader::open(path)
        .unwrap()
        .with_guessed_format()
        .unwrap()
        .into_dimensions();
    assert_eq!(
        dims.unwrap(),
        (64, 64),
        "the header of the cut PNG still reads"
    );
}

/// Images are decoded fully up front: a truncated PNG (valid header, data cut off) skips its
/// item as unreadable, naming the file, instead of failing at judge time.
#[test]
fn jsonl_truncated_png_is_skipped_as_unreadable() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path();
    write_png(&base.join("src.png"), 64, 64);
    write_png(&base.join("edit.png"), 64, 64);
    let cut = base.join("cut.png");
    write_truncated_png(&cut);
    let lines = [
        json!({"id": "a", "category": "c", "instruction": "i", "source": "src.png", "edited": "edit.png"}),
        json!({"id": "b", "category": "c", "instruction": "i", "source": "src.png", "edited": "cut.png"}),
        json!({"id": "c", "category": "c", "instruction": "i", "source": "cut.png", "edited": "edit.png"}),
        json!({"id": "d", "category": "c", "instruction": "i", "source": "src.png", "edited": "edit.png"}),
    ];
    let path = base.join("bench.jsonl");
    std::fs::write(
        &path,
        lines.iter().map(|l| format!("{l}\n")).collect::<String>(),
    )
    .unwrap();
    let loaded = load_jsonl(&path, base).unwrap();
    let ids: Vec<&str> = loaded.items.iter().map(|i| i.id.as_str()).collect();
    assert_eq!(ids, ["a", "d"], "{loaded}: {:?}", loaded.skipped);
    let got: Vec<(&str, SkipKind)> = loaded
        .skipped
        .iter()
        .map(|s| (s.id.as_str(), s.kind))
        .collect();
    assert_eq!(
        got,
        [
            ("b", SkipKind::UnreadableImage),
            ("c", SkipKind::UnreadableImage)
        ]
    );
    for (s, role) in loaded.skipped.iter().zip(["edited", "source"]) {
        let r = &s.reason;
        assert!(r.contains(&cut.display().to_string()), "{r}");
        assert!(r.contains(role) && r.contains("cut short"), "{r}");
        assert!(r.contains("re-save it as PNG"), "{r}");
    }
}

#[test]
fn gedit_truncated_png_is_skipped_as_unreadable() {
    let dir = tempfile::tempdir().unwrap();
    let full = dir.path().join("fullset");
    write_png(&full.join("color_alter/en/k1_SRCIMG.png"), 16, 16);
    write_png(&full.join("color_alter/en/k1.png"), 16, 16);
    write_truncated_png(&full.join("color_alter/en/k2_SRCIMG.png"));
    write_png(&full.join("color_alter/en/k2.png"), 16, 16);
    let rows = [
        json!({"task_type": "color_alter", "key": "k1", "instruction": "red", "instruction_language": "en"}),
        json!({"task_type": "color_alter", "key": "k2", "instruction": "blue", "instruction_language": "en"}),
    ];
    let rows_path = dir.path().join("rows.jsonl");
    std::fs::write(
        &rows_path,
        rows.iter().map(|r| format!("{r}\n")).collect::<String>(),
    )
    .unwrap();
    let loaded = load_gedit(dir.path(), "en", None, &rows_path).unwrap();
    assert_eq!(loaded.items.len(), 1, "{loaded}: {:?}", loaded.skipped);
    assert_eq!(loaded.items[0].id, "k1");
    assert_eq!(loaded.skipped.len(), 1);
    let s = &loaded.skipped[0];
    assert_eq!((s.id.as_str(), s.kind), ("k2", SkipKind::UnreadableImage));
    assert!(
        s.reason.contains("k2_SRCIMG.png") && s.reason.contains("line 2"),
        "{}",
        s.reason
    );
}

/// A JSONL line with a byte that is not UTF-8 is skipped as `line N` naming the line and the
/// byte's offset; the other lines (CRLF endings included) load.
#[test]
fn jsonl_non_utf8_line_is_skipped_with_its_line_number() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path();
    write_png(&base.join("a.png"), 4, 4);
    let good = |id: &str| {
        json!({"id": id, "category": "c", "instruction": "i", "source": "a.png", "edited": "a.png"})
            .to_string()
    };
    let prefix = br#"{"id": "b", "category": "c", "instruction": "bl"#;
    let mut bytes = Vec::new();
    bytes.extend_from_slice(good("a").as_bytes());
    bytes.extend_from_slice(b"\r\n\r\n");
    bytes.extend_from_slice(prefix);
    bytes.push(0xFF);
    bytes.extend_from_slice(br#"ue", "source": "a.png", "edited": "a.png"}"#);
    bytes.extend_from_slice(b"\r\n");
    bytes.extend_from_slice(good("c").as_bytes());
    bytes.extend_from_slice(b"\r\n");
    let path = base.join("bench.jsonl");
    std::fs::write(&path, bytes).unwrap();

    let loaded = load_jsonl(&path, base).unwrap();
    let ids: Vec<&str> = loaded.items.iter().map(|i| i.id.as_str()).collect();
    assert_eq!(ids, ["a", "c"], "{loaded}: {:?}", loaded.skipped);
    assert_eq!(loaded.skipped.len(), 1);
    let s = &loaded.skipped[0];
    assert_eq!((s.id.as_str(), s.kind), ("line 3", SkipKind::NotUtf8));
    for part in [
        "bench.jsonl",
        "line 3",
        &format!("byte offset {}", prefix.len()),
        "re-save the file as UTF-8",
    ] {
        assert!(s.reason.contains(part), "{part:?} not in {}", s.reason);
    }
    assert_eq!(loaded.to_string(), "2 items loaded, 1 skipped: 1 not UTF-8");
}

#[test]
fn gedit_non_utf8_row_is_skipped_with_its_line_number() {
    let dir = tempfile::tempdir().unwrap();
    let full = dir.path().join("fullset");
    write_png(&full.join("color_alter/en/k1_SRCIMG.png"), 4, 4);
    write_png(&full.join("color_alter/en/k1.png"), 4, 4);
    let good = json!({"task_type": "color_alter", "key": "k1", "instruction": "red", "instruction_language": "en"});
    let mut bytes = format!("{good}\n").into_bytes();
    bytes.extend_from_slice(
        b"{\"task_type\": \"color_alter\", \"key\": \"k2\", \"instruction\": \"caf\xE9\"}\n",
    );
    let rows_path = dir.path().join("rows.jsonl");
    std::fs::write(&rows_path, bytes).unwrap();
    let loaded = load_gedit(dir.path(), "en", None, &rows_path).unwrap();
    assert_eq!(loaded.items.len(), 1, "{loaded}: {:?}", loaded.skipped);
    assert_eq!(loaded.skipped.len(), 1);
    let s = &loaded.skipped[0];
    assert_eq!((s.id.as_str(), s.kind), ("line 2", SkipKind::NotUtf8));
    assert!(
        s.reason.contains("rows.jsonl") && s.reason.contains("line 2"),
        "{}",
        s.reason
    );
}

/// The scorer's JSON is one document, so a byte that is not UTF-8 refuses the file, with the
/// line and byte offset of that byte.
#[test]
fn scorer_json_non_utf8_byte_is_an_error_naming_its_line() {
    let dir = tempfile::tempdir().unwrap();
    let edited = dir.path().join("edited");
    write_png(&edited.join("p1.png"), 4, 4);
    let items = json!([scorer_item("物理", "p1.png", &b64(&png_bytes(4, 4)))]);
    let text = serde_json::to_string_pretty(&items).unwrap();
    let at = text.find("a red car").unwrap() + "a red ".len();
    let line = text[..at].matches('\n').count() + 1;
    assert!(line > 1);
    let mut bytes = text.into_bytes();
    bytes.insert(at, 0xFF);
    let json_path = dir.path().join("bench.json");
    std::fs::write(&json_path, bytes).unwrap();
    let err = load_scorer_json(&json_path, &edited, None).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, Error::NotUtf8 { .. }), "{msg}");
    for part in [
        "bench.json".to_string(),
        format!("line {line}"),
        format!("byte offset {at}"),
        "UTF-8".to_string(),
    ] {
        assert!(msg.contains(&part), "{part:?} not in {msg}");
    }
}
