"""The synthetic renderer's word boxes: each one frames the ink of the word it names."""

import numpy as np

from components.data.synthetic import generate_page, render_page


def test_every_word_box_frames_ink_and_body_words_follow_the_markup():
    for seed in range(5):
        rendered = render_page(seed)
        ink = np.asarray(rendered.image.convert("L")) < 128
        assert rendered.words
        for word, (x0, y0, x1, y1) in rendered.words:
            inside = ink[int(y0):int(np.ceil(y1)), int(x0):int(np.ceil(x1))]
            # a glyph run of the word's length fills its box: most columns hold ink
            assert inside.any(axis=0).mean() > 0.5, (seed, word)
            left = ink[int(y0) + 2:int(y1) - 2, max(0, int(x0) - 2):int(x0)]
            assert not left.any() or word[0] in "([", (seed, word)  # nothing drawn just before the word
        drawn = [w for w, _ in rendered.words]
        for element in rendered.page.elements:
            if element.category in ("text", "title"):
                words = element.content.split()
                starts = [i for i in range(len(drawn)) if drawn[i:i + len(words)] == words]
                assert starts, (seed, element.content)


def test_generate_page_is_render_page_without_the_words():
    page, image = generate_page(7)
    rendered = render_page(7)
    assert page == rendered.page
    assert np.array_equal(np.asarray(image), np.asarray(rendered.image))
