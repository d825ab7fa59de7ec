"""A formula's LaTeX → the tokens CDM colours one by one, as the official CDM prepares them.

The official code (UniMERNet ``cdm/``) does this in three passes, and so do we:

1. **Tokenise** (:func:`tokenize`): the formula is parsed and written back in the normal form
   of im2markup's KaTeX printer: tokens separated by spaces, every script argument braced
   (``x^2`` → ``x ^ { 2 }``), digits one by one, ``\\text{..}``/``\\mbox`` as ``\\mathrm { c h a r s }``,
   matrices, cases and aligned as ``\\begin{array}`` with their delimiters as ``\\left``/``\\right``,
   ``\\lim``-like operators as ``\\operatorname* { l i m }``. LaTeX the parser rejects is kept as
   written (the official code then goes on with the raw string).
2. **Normalise** (:func:`normalize`): named functions become upright letters
   (``\\sin`` → ``\\mathrm { s i n }``), dots become ``. . .``, ``\\big (`` one token, and the
   missing braces of ``\\frac``, ``\\sqrt``, accents and font commands are filled in.
3. **Colour** (:func:`colour_tokens`): every visible token is wrapped in its own
   ``\\mathcolor[RGB]{r,g,b}{..}``; structural tokens (braces, scripts, ``\\left``, spacing, font
   commands) are not tokens of their own.

This is our own code, written from the behaviour of the official one (checked token for token by
``benchmarks/cdm_parity.py``); a formula the official pipeline cannot prepare raises
:class:`FormulaError` here too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# ----- 1. tokenising ---------------------------------------------------------------------------
_LEX = re.compile(r"\\[a-zA-Z]+|\\.|\s+|.", re.DOTALL)

FRACTIONS = {"\\frac": "\\frac", "\\dfrac": "\\frac", "\\tfrac": "\\frac", "\\cfrac": "\\frac",
             "\\binom": "\\binom", "\\dbinom": "\\binom", "\\tbinom": "\\binom"}
ACCENTS = {"\\hat", "\\check", "\\tilde", "\\acute", "\\grave", "\\dot", "\\ddot", "\\breve", "\\bar", "\\vec",
           "\\widehat", "\\widetilde", "\\mathring", "\\underbrace", "\\overbrace", "\\overrightarrow",
           "\\overleftarrow"}
LINES = {"\\overline", "\\underline"}  # printed around a brace of their own: \overline { { A B } }
TWO_ARGUMENTS = {"\\stackrel", "\\overset", "\\underset"}
MATH_FONTS = {"\\mathrm", "\\mathbf", "\\mathit", "\\mathcal", "\\mathbb", "\\mathfrak", "\\mathsf", "\\mathtt",
              "\\boldsymbol", "\\bm", "\\mathscr", "\\pmb"}
TEXT_FONTS = {"\\text": "\\mathrm", "\\mbox": "\\mathrm", "\\hbox": "\\mathrm", "\\textrm": "\\textrm",
              "\\textbf": "\\textbf", "\\textit": "\\textit", "\\texttt": "\\texttt", "\\textsf": "\\textsf",
              "\\textnormal": "\\textnormal", "\\textup": "\\textup", "\\textmd": "\\textmd", "\\emph": "\\emph"}
SWITCHES = {"\\displaystyle", "\\textstyle", "\\scriptstyle", "\\scriptscriptstyle", "\\bf", "\\it", "\\sf", "\\tt",
            "\\cal", "\\tiny", "\\small", "\\normalsize", "\\large", "\\Large", "\\LARGE", "\\huge", "\\Huge"}
DELIMITER_SIZES = {f"\\{size}{side}" for size in ("big", "Big", "bigg", "Bigg") for side in ("", "l", "r", "m")}
# KaTeX's named operators: without limits they come back as themselves (the official post-pass
# turns \operatorname { s i n } back into \sin), with limits as \operatorname* { l i m }.
NAMED_FUNCTIONS = {"\\arcsin", "\\arccos", "\\arctan", "\\arg", "\\cos", "\\cosh", "\\cot", "\\coth", "\\csc",
                   "\\deg", "\\dim", "\\exp", "\\hom", "\\ker", "\\lg", "\\ln", "\\log", "\\sec", "\\sin",
                   "\\sinh", "\\tan", "\\tanh"}
LIMIT_OPERATORS = {"\\det", "\\gcd", "\\inf", "\\lim", "\\liminf", "\\limsup", "\\max", "\\min", "\\Pr", "\\sup"}
MATRICES = {"matrix": None, "pmatrix": ("(", ")"), "bmatrix": ("[", "]"), "Bmatrix": ("\\{", "\\}"),
            "vmatrix": ("|", "|"), "Vmatrix": ("\\Vert", "\\Vert")}
ALIGNED = {"aligned", "split", "align", "align*", "alignat", "alignat*", "eqnarray", "eqnarray*"}
DROPPED = {"\\limits", "\\nolimits"}
UNSUPPORTED = {"\\color", "\\textcolor"}  # KaTeX's printer has no form for them: the formula stays raw
OPERATOR_NAMES = {name[1:] for name in NAMED_FUNCTIONS | LIMIT_OPERATORS} | {"injlim", "projlim"}


class FormulaError(ValueError):
    """LaTeX the official CDM pipeline cannot prepare (unbalanced braces, a command missing its argument)."""


@dataclass
class _Group:
    tokens: list[str] = field(default_factory=list)
    braced: bool = False  # an ordgroup: printed with its own braces


class _Parser:
    def __init__(self, latex: str):
        self.tokens = [t for t in _LEX.findall(latex)]
        self.i = 0

    # -- helpers
    def peek(self, skip_space: bool = True) -> str | None:
        j = self.i
        while skip_space and j < len(self.tokens) and self.tokens[j].isspace():
            j += 1
        return self.tokens[j] if j < len(self.tokens) else None

    def take(self, skip_space: bool = True) -> str:
        while skip_space and self.i < len(self.tokens) and self.tokens[self.i].isspace():
            self.i += 1
        if self.i >= len(self.tokens):
            raise FormulaError("unexpected end of formula")
        token = self.tokens[self.i]
        self.i += 1
        return token

    def raw_argument(self) -> str:
        """The text of a ``{...}`` argument (environment names, column specs)."""
        if self.take() != "{":
            raise FormulaError("expected {")
        depth, text = 1, []
        while True:
            token = self.take(skip_space=False)
            depth += (token == "{") - (token == "}")
            if depth == 0:
                return "".join(text)
            text.append(token)

    # -- expressions
    def expression(self, stops: set[str]) -> list[str]:
        out: list[str] = []
        while (token := self.peek()) is not None and token not in stops:
            if token == "}":
                raise FormulaError("unbalanced }")
            if token in SWITCHES:  # a switch applies to the rest of its group
                self.take()
                out.append(token)
                continue
            if token == "\\rm":
                self.take()
                out += ["\\mathrm", "{", *self.expression(stops | {"}"}), "}"]
                continue
            out += self.with_scripts()
        return out

    def with_scripts(self) -> list[str]:
        base = self.atom()
        sub: _Group | None = None
        sup: _Group | None = None
        primes = 0
        while self.peek() in ("^", "_", "'"):
            token = self.take()
            if token == "'":
                primes += 1
            elif token == "_":
                if sub is not None:
                    raise FormulaError("double subscript")
                sub = self.argument(optional=True)
            else:
                if sup is not None:
                    raise FormulaError("double superscript")
                sup = self.argument(optional=True)
                primes = 0  # KaTeX's printer drops primes that an explicit superscript follows
        if primes and sup is None:
            sup = _Group(["{", *["\\prime"] * primes, "}"], braced=True)
        out = list(base.tokens)
        for mark, script in (("_", sub), ("^", sup)):
            if script is not None and script.tokens:  # a script missing its argument is dropped
                out += [mark, *script_tokens(script)]
        return out

    def argument(self, optional: bool = False) -> _Group:
        """One argument: a braced group or a single atom (a script missing its argument is dropped)."""
        if self.peek() is None or self.peek() in ("}", "&", "\\\\", "\\end", "\\right"):
            if optional:
                return _Group()
            raise FormulaError("missing argument")
        return self.atom()

    def braced(self) -> _Group:
        self.take()  # {
        inner = self.expression({"}"})
        if self.peek() != "}":
            raise FormulaError("unbalanced {")
        self.take()
        return _Group(["{", *inner, "}"], braced=True)

    def atom(self) -> _Group:
        token = self.peek()
        if token == "{":
            return self.braced()
        token = self.take()
        if token in ("^", "_", "'"):  # a script with no base: KaTeX gives it an empty one
            self.i -= 1
            return _Group()
        if token in FRACTIONS:
            first, second = self.argument(), self.argument()
            return _Group([FRACTIONS[token], *first.tokens, *second.tokens])
        if token in TWO_ARGUMENTS:
            first, second = self.argument(), self.argument()
            return _Group([token, *first.tokens, *second.tokens])
        if token == "\\sqrt":
            out = ["\\sqrt"]
            if self.peek() == "[":
                self.take()
                out += ["[", *self.expression({"]"}), "]"]
                self.take()
            return _Group(out + self.argument().tokens)
        if token in ("\\xrightarrow", "\\xleftarrow"):
            out = [token]
            if self.peek() == "[":
                self.take()
                out += ["[", *self.expression({"]"}), "]"]
                self.take()
            return _Group(out + self.argument().tokens)
        if token in ACCENTS:
            return _Group([token, *script_tokens(self.argument())])
        if token in LINES:
            return _Group([token, "{", *self.argument().tokens, "}"])
        if token in MATH_FONTS:
            return _Group([token, *self.argument().tokens])
        if token in TEXT_FONTS:
            return _Group([TEXT_FONTS[token], "{", *self.text(), "}"])
        if token in ("\\operatorname", "\\operatorname*"):
            star = token.endswith("*") or self.peek(skip_space=False) == "*"
            if self.peek(skip_space=False) == "*":
                self.take()
            name = self.raw_argument().replace(" ", "")
            if not star and name in OPERATOR_NAMES:  # the official post-pass: \operatorname{sin} is \sin
                return _Group(["\\" + name])
            return _Group(["\\operatorname*" if star else "\\operatorname", "{", *name, "}"])
        if token in NAMED_FUNCTIONS:
            return _Group([token])
        if token in LIMIT_OPERATORS:
            return _Group(["\\operatorname*", "{", *token[1:], "}"])
        if token == "\\left":
            left = self.take()
            body = self.expression({"\\right"})
            if self.peek() != "\\right":
                raise FormulaError("\\left without \\right")
            self.take()
            right = self.take()
            return _Group(["\\left" + left, *body, "\\right" + right])
        if token in DELIMITER_SIZES:
            return _Group([token, self.take()])
        if token == "\\begin":  # an environment: matrices, cases and aligned print as \begin{array}
            return _Group(self.environment(self.raw_argument()))
        if token in ("\\end", "\\right", "&", "\\\\"):
            raise FormulaError(f"unexpected {token}")
        if token in DROPPED:
            return _Group()
        if token in UNSUPPORTED:
            raise FormulaError(f"{token} is not printed by KaTeX's normaliser")
        if token in ("\\ ", "~"):
            return _Group([token])
        return _Group([token])

    def text(self) -> list[str]:
        """A text argument: each character its own token, spaces as ``~``."""
        if self.peek() != "{":
            return [self.take()]
        self.take()
        out, depth = [], 1
        while True:
            token = self.take(skip_space=False)
            depth += (token == "{") - (token == "}")
            if depth == 0:
                return out
            if token in ("{", "}"):
                continue
            out += ["~"] if token.isspace() else list(token) if not token.startswith("\\") else [token]

    def environment(self, name: str) -> list[str]:
        columns: list[str] | None = None
        if name == "array":
            columns = [c for c in self.raw_argument() if c in "lcr"]
        elif name == "cases":
            columns = ["l", "l"]
        rows: list[list[list[str]]] = [[[]]]
        while True:
            token = self.peek()
            if token is None:
                raise FormulaError(f"\\begin{{{name}}} without \\end")
            if token == "\\end":
                self.take()
                if self.raw_argument() != name:
                    raise FormulaError(f"\\begin{{{name}}} ended by another environment")
                break
            if token == "&":
                self.take()
                rows[-1].append([])
            elif token == "\\\\":
                self.take()
                rows.append([[]])
            else:
                rows[-1][-1] += self.with_scripts()
        if name in ALIGNED:
            width = max(len(row) for row in rows)
            columns = ["r" if k % 2 == 0 else "l" for k in range(width)]
            rows = [[cell if k % 2 == 0 else ["{", "}", *cell] for k, cell in enumerate(row)] for row in rows]
        elif columns is None:
            columns = ["l"] * len(rows[0])
        out = ["\\begin{array}", "{", *columns, "}"]
        for row in rows:
            if not any(row):
                continue
            for k, cell in enumerate(row):
                if cell:
                    out += ["{", *cell, "}"]
                if k < len(row) - 1:
                    out.append("&")
            out.append("\\\\")
        if out[-1] == "\\\\":  # the official post-pass drops the last row's break
            out.pop()
        out.append("\\end{array}")
        if MATRICES.get(name):
            left, right = MATRICES[name]
            out = ["\\left" + left, *out, "\\right" + right]
        elif name == "cases":
            out = ["\\left\\{", *out, "\\right."]
        return out


def script_tokens(group: _Group) -> list[str]:
    return group.tokens if group.braced else ["{", *group.tokens, "}"]


def _prepare(latex: str) -> str:
    """The official pre-pass on the raw string (comments, ``$``, ``\\label``, ``\\\\`` outside arrays)."""
    latex = latex.replace("\n", " ")
    latex = re.sub(r"\\begin{(split|align|alignedat|alignat|eqnarray)\*?}(.+?)\\end{\1\*?}",
                   r"\\begin{aligned}\2\\end{aligned}", latex, flags=re.S)
    latex = re.sub(r"\\begin{(smallmatrix)\*?}(.+?)\\end{\1\*?}", r"\\begin{matrix}\2\\end{matrix}", latex, flags=re.S)
    latex = re.sub(r"(?<!\\)%.*", "", latex)
    latex = latex.replace("\\~", " ").replace("\\>", " ")
    latex = latex.replace("$", " ")
    latex = re.sub(r"\\label{.*?}", "", latex)
    if not any(word in latex for word in ("matrix", "cases", "array", "begin")):
        latex = latex.replace("\\\\", "\\,")
    for spelling in ("{\\rm", "{ \\rm", "\\rm{"):
        latex = latex.replace(spelling, "\\mathrm{")
    return latex


def tokenize(latex: str) -> str:
    """KaTeX-normal form, tokens separated by single spaces; the raw string when it does not parse."""
    try:
        parser = _Parser(_prepare(latex))
        tokens = parser.expression(set())
        if parser.peek() is not None:
            raise FormulaError(f"unexpected {parser.peek()}")
    except FormulaError:
        return latex.replace("\n", " ")
    return " ".join(tokens)


# ----- 2. normalising --------------------------------------------------------------------------
TWO_TAIL = ("\\frac", "\\binom")
SQRT_LIKE = ("\\xrightarrow", "\\xleftarrow", "\\sqrt")
INVISIBLE_TWO_TAIL = ("\\overset", "\\underset", "\\stackrel")
ONE_TAIL = ("\\widetilde", "\\overline", "\\hat", "\\widehat", "\\tilde", "\\Tilde", "\\dot", "\\bar", "\\vec",
            "\\underline", "\\underbrace", "\\check", "\\breve", "\\Bar", "\\Vec", "\\mathring", "\\ddot", "\\Ddot",
            "\\dddot", "\\ddddot")
INVISIBLE_ONE_TAIL = ("\\boldsymbol", "\\pmb", "\\textbf", "\\mathrm", "\\mathbf", "\\mathbb", "\\mathcal",
                      "\\textmd", "\\texttt", "\\textnormal", "\\text", "\\textit", "\\textup", "\\mathop",
                      "\\mathbin", "\\smash", "\\operatorname", "\\textrm", "\\mathfrak", "\\emph", "\\textsf",
                      "\\textsc")
ELLIPSES = ("--", "---", "…", "\\ldots", "\\hdots", "\\cdots", "\\dddot", "\\dots", "\\dotsc", "\\dotsi", "\\dotsm",
            "\\dotso", "\\dotsb", "\\mathellipsis")
UPRIGHT_NAMES = ("ex", "ln", "lg", "cot", "mod", "bmod", "pmod", "min", "max", "ker", "hom", "sec", "scs", "csc",
                 "deg", "arg", "log", "dim", "exp", "sin", "cos", "tan", "tanh", "cosh", "sinh", "coth", "arcsin",
                 "arccos", "arctan")
_MOD_SPELLING = {"bmod": "mod", "pmod": "mod"}
_COLOUR_COMMANDS = re.compile(r"\\(?:colorbox|color|textcolor|cellcolor)[ \[\]RGBrgb]+{ [A-Za-z 0-9,!]+ } ")


def matching_brace(tokens: list[str], start: int, pair: tuple[str, str] = ("{", "}")) -> int:
    """Index of the token closing the one at ``start``; -1 when ``start`` opens nothing."""
    depth = 0
    for i in range(start, len(tokens)):
        if tokens[i] == pair[0]:
            depth += 1
        elif tokens[i] == pair[1]:
            depth -= 1
            if depth == 0:
                return i
    if depth > 0:
        raise FormulaError("no matching brace")
    return -1


def _join_spaced(text: str, pattern: str, suffix: str = " ") -> str:
    """Every match of ``pattern`` written without its inner spaces (one token)."""
    for found in re.findall(pattern, text, re.DOTALL):
        text = text.replace(found, found.replace(" ", "") + suffix)
    return text


def normalize(tokenized: str) -> str:
    """The official normalisation of a tokenised formula (its rules for formulas, not tables)."""
    text = tokenized.strip().replace("\\pmatrix", "\\mypmatrix").replace("\\matrix", "\\mymatrix")
    for dropped in ("\\raggedright", "\\arraybackslash", "\\lowercase", "\\uppercase"):
        text = text.replace(dropped, "")
    for found in re.findall(r"\\[hv]space { [.0-9a-z ]+ }", text, re.DOTALL):
        text = text.replace(found, found.replace(" ", ""))
    for found in re.findall(r"\\begin{array} { [lrc ]+ }", text, re.DOTALL):
        text = text.replace(found, "\\begin{array} " + found.removeprefix("\\begin{array} ").replace(" ", ""))
    text = f" {text} "
    for ellipsis in ELLIPSES:
        dots = {"--": "- -", "---": "- - -"}.get(ellipsis, ". . .")
        text = re.sub(r"(?<=\s)" + re.escape(ellipsis) + r"(?=\s)", dots, text)
    for name in UPRIGHT_NAMES:
        spelled = " ".join(_MOD_SPELLING.get(name, name))
        text = re.sub(r"(?<=\s)\\" + name + r"(?=\s)", lambda _m, s=spelled: "\\mathrm { " + s + " }", text)
    text = _join_spaced(text, r"\\string [^ ]+ ")
    text = _join_spaced(text, r"\\[Bb]ig[g]?[glrm]? [(){}|\[\]] ")
    text = _join_spaced(text, r"\\[Bb]ig[g]?[glrm]? \\.*? ")
    text = text.replace("\\operatorname *", "\\operatorname")
    text = text.replace("\\lefteqn", "").replace("\\footnote ", "^ ")
    text = _join_spaced(text, r"\\' [^{] ")
    for pattern in (r"\\parbox {[^{]+}", r"\\rule {[ .0-9a-z]+} {[ .0-9a-z]+}",
                    r"\\specialrule {[ .0-9a-z]+} {[ .0-9a-z]+} {[ .0-9a-z]+}"):
        text = _join_spaced(text, pattern, suffix="")
    for found in re.findall(r"\\raisebox {[^{]+} [\[\]0-9 exptcm]+{", text, re.DOTALL):
        text = text.replace(found, found.replace(" ", "")[:-1] + " {")
    for found in re.findall(r"{ \\char[0-9' ]+}", text, re.DOTALL):
        text = text.replace(found, "{ " + found.replace(" ", "")[1:-1] + " }")
    for found in _COLOUR_COMMANDS.findall(text):
        text = text.replace(found, "")
    return " ".join(_fill_braces(text.split(" ")))


def _braced_at(tokens: list[str], k: int) -> list[str]:
    """The token at ``k`` made a group of its own."""
    return [*tokens[:k], "{", tokens[k], "}", *tokens[k + 1:]]


def _fill_braces(tokens: list[str]) -> list[str]:
    """Braces the official code adds so that every command's argument is a group."""
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token in ONE_TAIL + INVISIBLE_ONE_TAIL:
            j = i + 1
            while j < len(tokens) and tokens[j] in ONE_TAIL + INVISIBLE_ONE_TAIL:
                j += 1
            head = tokens[:i]
            for k in range(i, j):
                head += [tokens[k], "{"]
            if j >= len(tokens):
                raise FormulaError(f"{token} without an argument")
            if tokens[j] != "{":
                tokens = head + [tokens[j]] + ["}"] * (j - i) + tokens[j + 1:]
            else:
                end = matching_brace(tokens, j)
                tokens = head + tokens[j + 1:end] + ["}"] * (j - i) + tokens[end + 1:]
        elif token in SQRT_LIKE:
            if tokens[i + 1] not in ("[", "{"):
                tokens = _braced_at(tokens, i + 1)
            else:
                end = matching_brace(tokens, i + 1, ("[", "]")) if tokens[i + 1] == "[" else i
                if tokens[end + 1] != "{":
                    tokens = _braced_at(tokens, end + 1)
        elif token in TWO_TAIL + INVISIBLE_TWO_TAIL:
            if tokens[i + 1] != "{":
                tokens = _braced_at(tokens, i + 1)
            end = matching_brace(tokens, i + 1)
            if tokens[end + 1] != "{":
                tokens = _braced_at(tokens, end + 1)
        i += 1
    return tokens


# ----- 3. colouring ----------------------------------------------------------------------------
SKIPPED = {"\\", "\\\\", "\\index", "\\a", "&", "$", "\\multirow", "\\def", "\\edef", "\\raggedright", "\\url",
           "\\cr", "\\ensuremath", "\\left", "\\right", "\\mathchoice", "\\scriptstyle", "\\displaystyle",
           "\\qquad", "\\quad", "\\,", "\\!", "~", "\\boldmath", "\\gdef", "\\today", "\\the"}
SKIPPED_PATTERNS = [re.compile(p) for p in (r"\{", r"\}", r"[\[\]]", r"\\begin\{.*?\}", r"\\end\{.*?\}", r"\^",
                                            r"\_", r"\\.*rule.*", r"\\.*line.*", r"\[[\-.0-9]+[epm][xtm]\]")]
PHANTOMS = {"\\fontfamily", "\\vphantom", "\\phantom", "\\rowcolor", "\\ref", "\\thesubequation", "\\global",
            "\\theboldgroup"}


def _colour(index: int) -> str:
    return f"\\mathcolor[RGB]{{<color_{index}>}}{{"


def colour_tokens(normalized: str) -> tuple[str, list[str]]:
    """The formula with each visible token wrapped in its colour placeholder ``<color_k>``, and
    the tokens in colour order (the k-th token is painted with the k-th colour)."""
    tokens = normalized.strip().split(" ")
    found: list[str] = []
    i = 0
    while i < len(tokens):
        tokens, i = _colour_at(tokens, i, found)
    return " ".join(tokens), found


def _colour_at(tokens: list[str], i: int, found: list[str], in_brackets: bool = False) -> tuple[list[str], int]:
    token = tokens[i]
    if not token:
        return tokens, i + 1
    if token in PHANTOMS:
        end = matching_brace(tokens, i + 1) if i + 1 < len(tokens) and tokens[i + 1] == "{" else i + 1
        return tokens, end + 1
    if token in TWO_TAIL:
        numerator_end = matching_brace(tokens, i + 1)
        end = matching_brace(tokens, numerator_end + 1)
        tokens = [*tokens[:i], _colour(len(found)) + token, *tokens[i + 1:end + 1], "}", *tokens[end + 1:]]
        found.append(token)
        return tokens, i + 1
    if token in ONE_TAIL:
        end = matching_brace(tokens, i + 1)
        scripted = token != "\\underbrace" and end + 1 < len(tokens) and tokens[end + 1] == "_"
        opening, closing = ("{", "}}") if scripted else ("", "}")
        tokens = [*tokens[:i], opening + _colour(len(found)) + token, *tokens[i + 1:end + 1], closing,
                  *tokens[end + 1:]]
        found.append(token)
        return tokens, i + 1
    if token in INVISIBLE_ONE_TAIL:
        start = i + 1
        end = matching_brace(tokens, start)
        if end - start == 2:
            found.append(tokens[start + 1])
            tokens = [*tokens[:start + 1], _colour(len(found) - 1) + tokens[start + 1] + "}", *tokens[end:]]
        else:
            j = start + 1
            while j < end:
                tokens, j = _colour_at(tokens, j, found)
        return tokens, end + 1
    if token in SQRT_LIKE:
        if tokens[i + 1] == "{":
            end = matching_brace(tokens, i + 1)
            tokens = [*tokens[:i], _colour(len(found)) + token, *tokens[i + 1:end + 1], "}", *tokens[end + 1:]]
            found.append(token)
            j = i + 2
            while j < end:
                tokens, j = _colour_at(tokens, j, found)
            return tokens, end + 1
        if tokens[i + 1] == "[":
            index_end = matching_brace(tokens, i + 1, ("[", "]"))
            end = matching_brace(tokens, index_end + 1)
            tokens = [*tokens[:i], _colour(len(found)) + token, *tokens[i + 1:end + 1], "}", *tokens[end + 1:]]
            found.append(token)
            j = i + 2
            while j < index_end:
                tokens, j = _colour_at(tokens, j, found, in_brackets=True)
            j = index_end + 2
            while j < end:
                tokens, j = _colour_at(tokens, j, found)
            return tokens, end + 1
        return tokens, i + 1
    if token in ("\\multicolumn", "\\multirow"):
        first_end = matching_brace(tokens, i + 1)
        second_end = matching_brace(tokens, first_end + 1)
        third_end = matching_brace(tokens, second_end + 1)
        j = second_end + 2
        while j < third_end:
            tokens, j = _colour_at(tokens, j, found)
        return tokens, third_end + 1
    if token in SKIPPED or token in INVISIBLE_TWO_TAIL or any(p.match(token) for p in SKIPPED_PATTERNS):
        lone_bracket = (token == "[" and tokens[i - 1] != "\\sqrt") or (
            token == "]" and i >= 3 and tokens[i - 3] != "\\sqrt")
        if lone_bracket:
            tokens = [*tokens[:i], _colour(len(found)) + token + "}", *tokens[i + 1:]]
            found.append(token)
        return tokens, i + 1
    wrapped = _colour(len(found)) + token + "}"
    if in_brackets or (i > 1 and tokens[i - 1] == "_"):
        wrapped = "{" + wrapped + "}"
    tokens = [*tokens[:i], wrapped, *tokens[i + 1:]]
    found.append(token)
    return tokens, i + 1
