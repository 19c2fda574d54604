// kstatus-check prints what kstatus (sigs.k8s.io/cli-utils/pkg/kstatus/status.Compute, the library behind
// Flux's and kpt's health checks) decides for each object of a JSON array read from stdin: a JSON array of
// {"status": "Current|InProgress|Failed|Terminating|...", "message": "..."} on stdout, in input order.
//
// pdserve's tests feed it the PDService statuses the operator computes, so the GitOps semantics are checked
// against the real rules instead of a transcription of them.
package main

import (
	"encoding/json"
	"fmt"
	"os"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	utiljson "k8s.io/apimachinery/pkg/util/json"
	"sigs.k8s.io/cli-utils/pkg/kstatus/status"
)

type verdict struct {
	Status  string `json:"status"`
	Message string `json:"message"`
}

func main() {
	var raw []json.RawMessage
	if err := json.NewDecoder(os.Stdin).Decode(&raw); err != nil {
		fmt.Fprintln(os.Stderr, "kstatus-check: expected a JSON array of objects on stdin:", err)
		os.Exit(2)
	}
	out := make([]verdict, 0, len(raw))
	for i, item := range raw {
		// apimachinery's JSON decoder turns whole numbers into int64, as unstructured objects from the API
		// server have them (encoding/json would give float64, which kstatus' NestedInt64 rejects).
		obj := map[string]interface{}{}
		if err := utiljson.Unmarshal(item, &obj); err != nil {
			fmt.Fprintf(os.Stderr, "kstatus-check: object %d: %v\n", i, err)
			os.Exit(2)
		}
		result, err := status.Compute(&unstructured.Unstructured{Object: obj})
		if err != nil {
			fmt.Fprintf(os.Stderr, "kstatus-check: object %d: %v\n", i, err)
			os.Exit(1)
		}
		out = append(out, verdict{Status: string(result.Status), Message: result.Message})
	}
	if err := json.NewEncoder(os.Stdout).Encode(out); err != nil {
		fmt.Fprintln(os.Stderr, "kstatus-check:", err)
		os.Exit(1)
	}
}
