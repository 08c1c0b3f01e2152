//! The answer parser on adversarial replies: what must parse, and what must stay unparsed.

use fleet_data::answer::{parse_answer, parse_answer_with_options, ParsedAnswer, UnparsedReason};

use ParsedAnswer::Option as Opt;
use UnparsedReason::*;

fn un(reason: UnparsedReason) -> ParsedAnswer {
    ParsedAnswer::Unparsed { reason }
}

/// Checks a table of (reply, expected) with `n` options, reporting every mismatch at once.
fn check(n: usize, cases: &[(&str, ParsedAnswer)]) {
    let failures: Vec<String> = cases
        .iter()
        .filter_map(|(text, want)| {
            let got = parse_answer(text, n);
            (got != *want).then(|| format!("{text:?}: got {got:?}, want {want:?}"))
        })
        .collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

fn check_with(options: &[&str], cases: &[(&str, ParsedAnswer)]) {
    let failures: Vec<String> = cases
        .iter()
        .filter_map(|(text, want)| {
            let got = parse_answer_with_options(text, options);
            (got != *want).then(|| format!("{text:?}: got {got:?}, want {want:?}"))
        })
        .collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn explicit_statements_parse() {
    check(
        4,
        &[
            ("The answer is 3", Opt(2)),
            ("The answer is 3.", Opt(2)),
            ("Answer: (B)", Opt(1)),
            ("**Answer:** 2", Opt(1)),
            ("**Answer: 2**", Opt(1)),
            ("Answer: **B**", Opt(1)),
            ("Final answer: option 4", Opt(3)),
            ("\\boxed{2}", Opt(1)),
            ("Therefore the final answer is $\\boxed{3}$.", Opt(2)),
            ("$\\boxed{\\text{B}}$", Opt(1)),
            ("\\boxed{\\text{(C)}}", Opt(2)),
            ("The correct answer is option 1 (O-DU).", Opt(0)),
            (
                "The correct option is 2 because the O-DU hosts the RLC.",
                Opt(1),
            ),
            ("Best choice: C", Opt(2)),
            ("The answer would be D.", Opt(3)),
            ("The answer is B because the O-DU hosts RLC.", Opt(1)),
            ("ANSWER: 4", Opt(3)),
            ("answer = 1", Opt(0)),
            ("The answer is: (b)", Opt(1)),
            ("Option 3 is correct.", Opt(2)),
            ("(B) is the correct answer.", Opt(1)),
            ("So 4 is the right answer", Opt(3)),
            ("### Final Answer\n\n**2**", Opt(1)),
            ("**Answer:**\n3", Opt(2)),
            ("The answer is 3, not 2.", Opt(2)),
            ("The answer is 2 (Release 15 of 3GPP TS 38.401).", Opt(1)),
            ("Answer: 2. 3GPP defines the F1 interface.", Opt(1)),
        ],
    );
}

#[test]
fn the_last_explicit_statement_wins() {
    check(
        4,
        &[
            (
                "The answer is 2.\nWait, re-checking section 5.\nThe answer is 3.",
                Opt(2),
            ),
            ("Answer: A\n\nOn reflection, Final answer: C", Opt(2)),
            ("\\boxed{1}\n\nActually the correct option is 4.", Opt(3)),
            // Same option twice on the last line is fine.
            ("The answer is 2. Final answer: 2", Opt(1)),
            ("The answer is B, i.e. option 2 is correct.", Opt(1)),
            // An earlier out-of-range guess does not matter once a later line decides.
            ("Answer: 7?\nNo - the answer is 1.", Opt(0)),
        ],
    );
}

#[test]
fn bare_labels_as_the_whole_reply() {
    check(
        4,
        &[
            ("3", Opt(2)),
            ("  3\n", Opt(2)),
            ("(C)", Opt(2)),
            ("C.", Opt(2)),
            ("c", Opt(2)),
            ("**2**", Opt(1)),
            ("Option 3", Opt(2)),
            ("3)", Opt(2)),
            ("[D]", Opt(3)),
            ("`1`", Opt(0)),
        ],
    );
}

#[test]
fn think_blocks_are_removed() {
    check(
        4,
        &[
            (
                "<think>The answer is 2? No...</think>\n\nThe answer is 3",
                Opt(2),
            ),
            ("<think>\nAnswer: 1\n</think>\n4", Opt(3)),
            ("<THINK>answer is 1</THINK> Answer: 2", Opt(1)),
            // The chat template opened the block in the prompt: only a closing tag.
            ("so the answer is 1\n</think>\n\nThe answer is 4.", Opt(3)),
            (
                "<think>a</think> x <think>The answer is 1</think> Answer: 2",
                Opt(1),
            ),
            // Unterminated: the model ran out of tokens while thinking.
            (
                "<think>The answer is 2, let me verify",
                un(UnterminatedThink),
            ),
            ("The answer is 2 <think> hmm", un(UnterminatedThink)),
            ("<think>Answer: 3</think>", un(Empty)),
            ("<think>Answer: 3</think>\n   \n", un(Empty)),
            ("", un(Empty)),
            ("   \n\t", un(Empty)),
        ],
    );
}

#[test]
fn ambiguous_replies_stay_unparsed() {
    check(
        4,
        &[
            ("2 or 3", un(Ambiguous)),
            ("The answer is 2 or 3.", un(Ambiguous)),
            ("The answer is either B or C", un(Ambiguous)),
            ("Answer: (A) and (C)", un(Ambiguous)),
            ("Answer: 2/3", un(Ambiguous)),
            ("Answer: B/C", un(Ambiguous)),
            ("Answer: 1, 2", un(Ambiguous)),
            ("The answer is 2 (or possibly 3).", un(Ambiguous)),
            ("The answer is 2, but 4 is also plausible.", un(Ambiguous)),
            ("The answer is 2. Final answer: 3", un(Ambiguous)),
            ("The answer is 2, no wait, the answer is 3", un(Ambiguous)),
            ("\\boxed{2, 3}", un(Ambiguous)),
            ("\\boxed{2 \\text{ or } 3}", un(Ambiguous)),
            ("2-3", un(Ambiguous)),
            ("Option 2 is correct. Option 3 is correct.", un(Ambiguous)),
        ],
    );
}

#[test]
fn out_of_range_labels_are_not_clipped() {
    check(
        4,
        &[
            ("The answer is 7", un(OutOfRange)),
            ("7", un(OutOfRange)),
            ("Answer: E", un(OutOfRange)),
            ("(E)", un(OutOfRange)),
            ("Answer: 0", un(OutOfRange)),
            ("\\boxed{5}", un(OutOfRange)),
            ("The answer is 15.", un(OutOfRange)),
            // A valid earlier guess does not rescue an out-of-range final statement.
            ("The answer is 2.\nFinal answer: 6", un(OutOfRange)),
        ],
    );
    // With 6 options (ORAN medium has one such item) 6 and F are fine.
    check(
        6,
        &[
            ("Answer: 6", Opt(5)),
            ("Answer: F", Opt(5)),
            ("7", un(OutOfRange)),
        ],
    );
    // With 3 options D is out of range.
    check(3, &[("Answer: D", un(OutOfRange)), ("Answer: C", Opt(2))]);
}

#[test]
fn numbers_inside_other_text_are_not_labels() {
    check(
        4,
        &[
            ("3GPP", un(NoAnswer)),
            ("The answer is 3GPP.", un(NoAnswer)),
            ("Release 15", un(NoAnswer)),
            ("O-RAN.WG4", un(NoAnswer)),
            ("The answer is O-RAN.WG4", un(NoAnswer)),
            ("In step 1 we note that step 2 is correct.", un(NoAnswer)),
            ("According to Release 15 is correct behaviour", un(NoAnswer)),
            ("Answer: 2.5", un(NoAnswer)),
            ("2.5", un(NoAnswer)),
            ("The answer is 2 GHz", un(NoAnswer)),
            ("Answer: Rel-15", un(NoAnswer)),
            ("Answer: 3%", un(NoAnswer)),
            ("TS 38.401 section 4", un(NoAnswer)),
            (
                "1. First, consider the O-DU.\n2. Then the O-RU.\n3. So the fronthaul.",
                un(NoAnswer),
            ),
            ("I think the O-DU handles it.", un(NoAnswer)),
            (
                "Answer: A good choice depends on the deployment.",
                un(NoAnswer),
            ),
            ("The answer is a bit unclear", un(NoAnswer)),
            ("Answer the question with the option number.", un(NoAnswer)),
            ("The answer is not 3.", un(NoAnswer)),
            ("Option 3 is incorrect.", un(NoAnswer)),
            ("Is option 3 correct?", un(NoAnswer)),
            ("The answer is 3?", un(NoAnswer)),
            ("I", un(NoAnswer)),
            ("Answer: I am not sure", un(NoAnswer)),
            ("Let me find the answer\n1. First, the O-DU", un(NoAnswer)),
            ("Option A's scope covers it", un(NoAnswer)),
        ],
    );
}

#[test]
fn option_texts_when_the_options_are_known() {
    let options = [
        "Open Radio Access Network Distributed Unit",
        "Open Radio Access Network Data Unit",
        "O-RU",
        "O-RU and O-DU",
    ];
    check_with(
        &options,
        &[
            ("Open Radio Access Network Data Unit", Opt(1)),
            ("open radio access network data unit.", Opt(1)),
            ("The answer is O-RU.", Opt(2)),
            ("The answer is O-RU and O-DU.", Opt(3)),
            ("The answer is: **O-RU**", Opt(2)),
            ("2. Open Radio Access Network Data Unit", Opt(1)),
            ("Answer: 3. O-RU", Opt(2)),
            ("Answer: (3) O-RU. It terminates the fronthaul.", Opt(2)),
            // The label says one option, the text after it another.
            ("Answer: 2. O-RU", un(Ambiguous)),
            ("3. Open Radio Access Network Data Unit", un(Ambiguous)),
            // Text that only starts like an option is not a match.
            ("The answer is O-RU handles the RF", un(NoAnswer)),
            ("Open Radio Access Network", un(NoAnswer)),
            ("\\boxed{\\text{O-RU}}", Opt(2)),
            // Labels still work and win over text elsewhere.
            ("Answer: 4", Opt(3)),
        ],
    );
}

#[test]
fn a_number_that_is_also_an_option_text_is_ambiguous() {
    // ORAN-Bench has ~80 items with options such as 0, 1, 2, 3.
    let options = ["0", "1", "2", "3"];
    check_with(
        &options,
        &[
            ("2", un(Ambiguous)),
            ("The answer is 2", un(Ambiguous)),
            ("The answer is option 2", Opt(1)),
            ("Answer: 2. 1", Opt(1)),
            ("Answer: 3. 2", Opt(2)),
            ("Answer: B", Opt(1)),
            ("The answer is 0", un(OutOfRange)),
        ],
    );
    // Without the option texts the parser cannot know, and reads the label.
    check(4, &[("The answer is 2", Opt(1))]);
    // An option whose text is its own number is no conflict.
    check_with(
        &["1", "256", "65536", "4294967295"],
        &[("Answer: 1", Opt(0))],
    );
}

#[test]
fn letters_and_numbers_are_both_accepted() {
    for (i, (num, letter)) in [("1", "A"), ("2", "B"), ("3", "C"), ("4", "D"), ("5", "E")]
        .iter()
        .enumerate()
    {
        assert_eq!(parse_answer(&format!("Answer: {num}"), 5), Opt(i));
        assert_eq!(parse_answer(&format!("Answer: {letter}"), 5), Opt(i));
        assert_eq!(parse_answer(&format!("({letter})"), 5), Opt(i));
    }
}

#[test]
fn invalid_option_counts_are_reported_not_panicking() {
    assert_eq!(parse_answer("Answer: 1", 0), un(InvalidOptionCount));
    assert_eq!(parse_answer("Answer: 1", 1), un(InvalidOptionCount));
    assert_eq!(parse_answer("Answer: 1", 7), un(InvalidOptionCount));
    let none: [&str; 0] = [];
    assert_eq!(
        parse_answer_with_options("1", &none),
        un(InvalidOptionCount)
    );
    assert_eq!(parse_answer("Answer: B", 2), Opt(1));
}

#[test]
fn never_panics_on_odd_input() {
    let odd = [
        "\\boxed{",
        "\\boxed{}",
        "\\boxed",
        "}}}{{{",
        "Answer:",
        "answer is",
        "(((((",
        "**",
        "</think>",
        "<think></think>",
        "<think><think></think>",
        "Answer: ２",
        "答案是 3",
        "Ответ: 2",
        "🙂 Answer: 🙂",
        "Answer: 99999999999999999999999",
        "\u{0}\u{1}",
    ];
    for text in odd {
        for n in 0..8 {
            let _ = parse_answer(text, n);
            let _ = parse_answer_with_options(text, &["a", "b", "c"]);
        }
    }
    assert_eq!(parse_answer("<think><think></think>3", 4), Opt(2));
    assert_eq!(
        parse_answer("Answer: 99999999999999999999999", 4),
        un(NoAnswer)
    );
}

#[test]
fn serde_form_is_stable() {
    let parsed = Opt(2);
    let json = serde_json::to_string(&parsed).unwrap();
    assert_eq!(json, r#"{"status":"option","index":2}"#);
    let unparsed = un(Ambiguous);
    let json_u = serde_json::to_string(&unparsed).unwrap();
    assert_eq!(json_u, r#"{"status":"unparsed","reason":"ambiguous"}"#);
    assert_eq!(serde_json::from_str::<ParsedAnswer>(&json).unwrap(), parsed);
    assert_eq!(
        serde_json::from_str::<ParsedAnswer>(&json_u).unwrap(),
        unparsed
    );
    assert!(serde_json::from_str::<ParsedAnswer>(r#"{"status":"option"}"#).is_err());
    assert!(serde_json::from_str::<ParsedAnswer>(r#"{"status":"maybe","index":1}"#).is_err());
    for reason in UnparsedReason::ALL {
        let s = serde_json::to_string(&reason).unwrap();
        assert_eq!(s, format!("\"{}\"", reason.as_str()));
    }
    assert_eq!(unparsed.status(), "unparsed");
    assert_eq!(parsed.status(), "option");
    assert_eq!(unparsed.to_string(), "unparsed (ambiguous)");
}

#[test]
fn unparsed_is_never_correct() {
    for reason in UnparsedReason::ALL {
        for correct in 0..6 {
            assert!(!un(reason).is_correct(correct));
        }
    }
    assert!(Opt(1).is_correct(1));
    assert!(!Opt(1).is_correct(0));
}
