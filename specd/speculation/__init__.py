"""Proposers (draft model), draft trees and verification."""
