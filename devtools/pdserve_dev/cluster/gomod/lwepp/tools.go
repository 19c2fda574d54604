//go:build tools

// Package tools pins the reference endpoint picker as a dependency of this module, so `go build` of its
// main package resolves every dependency through this module's go.sum.
package tools

import _ "sigs.k8s.io/gateway-api-inference-extension/cmd/lwepp"
