"""Multimodal retrieval: encoders, KB records, the FAISS index, evaluation and the toy world."""

from retrieval.index import Hit, MultimodalIndex

__all__ = ["Hit", "MultimodalIndex"]
